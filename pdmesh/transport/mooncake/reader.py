"""Mooncake Transfer Engine reader: each batch of merged block runs is one batch read from the
producer's registered KV cache into a registered staging slab, then copied into the paged cache
(checksummed as it goes, like the shared-memory copy).

Why not straight into the paged cache: the engine cannot cancel a transfer. A read that timed out
may still land later, and by then vLLM has handed the failed blocks back to the request to
recompute; a late write would corrupt them unseen. A slab whose read failed is never used again
(it is freed once any straggler is long gone), so a failure can only ever cost recompute.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

import numpy as np

from pdmesh.errors import WorkerFailed
from pdmesh.transport.kv_layout import Copy
from pdmesh.transport.kv_transport import MOONCAKE, PeerLink, ReadOptions
from pdmesh.transport.mooncake.engine import MooncakeEngine
from pdmesh.transport.registered_reader import BATCH_NBYTES, RegisteredMemoryReader
from pdmesh.transport.kv_layout import LayerRegion

QUARANTINE_S = 300.0  # a failed read's slab is freed after this long
logger = logging.getLogger(__name__)


class MooncakeKVReader(RegisteredMemoryReader):
    transport = MOONCAKE

    def __init__(self, engine: MooncakeEngine, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if self._local_views is None:
            raise ValueError("this Mooncake build reads into host memory only")
        self._engine = engine
        self._slab_nbytes = max(BATCH_NBYTES, self._control.block_nbytes)
        self._lock = threading.Lock()
        self._slabs = threading.local()
        self._registered: list[np.ndarray] = []               # every live slab (for close)
        self._quarantined: list[tuple[float, np.ndarray]] = []  # (free after, slab)

    def connect(self, link: PeerLink) -> None:
        """Opens the engine's session to the producer with one small read (once per producer, before
        any request's read: concurrent first reads of a session are not what the engine is tested for)."""
        region = link.regions[0]
        self._read(link, [(region.base, 0, min(64, region.part_nbytes))])

    def _land(self, link: PeerLink, copies: list[Copy], local_block_ids: list[int],
              options: ReadOptions) -> list[int] | None:
        offsets = np.cumsum([0] + [c.nbytes for c in copies[:-1]]).tolist()
        slab = self._read(link, [(link.regions[c.layer].base + c.src, offset, c.nbytes)
                                 for c, offset in zip(copies, offsets)])
        view = memoryview(slab)
        return self._copy_out(copies, [(view, offset) for offset in offsets], len(local_block_ids), options)

    def _read(self, link: PeerLink, pieces: Sequence[tuple[int, int, int]]) -> np.ndarray:
        """Reads (remote address, slab offset, nbytes) pieces into this thread's slab; a failed read is
        tried once more on a fresh slab (the engine's TCP transport now and then times out a read
        between live peers here; a dead peer fails both)."""
        for attempt in range(2):
            slab = self._slab()
            base = slab.ctypes.data
            try:
                self._engine.read(link.mooncake_session, [base + offset for _, offset, _ in pieces],
                                  [address for address, _, _ in pieces], [nbytes for _, _, nbytes in pieces])
                return slab
            except WorkerFailed:
                self._quarantine(slab)
                if attempt:
                    raise
                logger.warning("Mooncake read from %s failed; trying once more", link.mooncake_session)
        raise AssertionError("unreachable")

    def _slab(self) -> np.ndarray:
        slab = getattr(self._slabs, "slab", None)
        if slab is None:
            slab = self._slabs.slab = np.empty(self._slab_nbytes, dtype=np.uint8)
            self._engine.register([_region_of(slab)])
            with self._lock:
                self._registered.append(slab)
                self._free_quarantined(time.monotonic())
        return slab

    def _quarantine(self, slab: np.ndarray) -> None:
        self._slabs.slab = None
        with self._lock:
            self._quarantined.append((time.monotonic() + QUARANTINE_S, slab))

    def _free_quarantined(self, now: float) -> None:
        for entry in [e for e in self._quarantined if e[0] <= now]:
            self._quarantined.remove(entry)
            self._engine.unregister([_region_of(entry[1])])
            self._registered = [s for s in self._registered if s is not entry[1]]

    def close(self) -> None:
        with self._lock:
            if self._registered:
                self._engine.unregister([_region_of(slab) for slab in self._registered])
            self._registered, self._quarantined = [], []


def _region_of(slab: np.ndarray) -> LayerRegion:
    return LayerRegion(base=slab.ctypes.data, nbytes=slab.nbytes, block_stride=0, part_stride=0, num_parts=1,
                       part_nbytes=slab.nbytes)

"""Mooncake Transfer Engine reader: each batch of merged block runs is read from the producer's
registered KV cache into a registered staging slab, then copied into the paged cache (checksummed
as it goes, like the shared-memory copy); the next batch's read is in flight meanwhile.

Why not straight into the paged cache: the engine cannot cancel a transfer. A read that timed out
may still land later, and by then vLLM has handed the failed blocks back to the request to
recompute; a late write would corrupt them unseen (kvcache-ai/Mooncake#4247). A slab whose read
failed or was given up is never used again (it is freed once any straggler is long gone), so a
failure can only ever cost recompute.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from decode.kv.registered_reader import BATCH_NBYTES, RegisteredMemoryReader
from pdmesh.kv.kv_layout import Copy, LayerRegion
from pdmesh.transport.kv_transport import MOONCAKE, PeerLink, ReadOptions
from pdmesh.transport.mooncake.engine import MooncakeEngine

QUARANTINE_S = 300.0  # a failed read's slab is freed after this long


@dataclass
class _Started:
    copies: list[Copy]
    slab: np.ndarray
    offsets: list[int]   # where each copy's bytes are in the slab
    batch_ids: list[int]


class MooncakeKVReader(RegisteredMemoryReader):
    transport = MOONCAKE

    def __init__(self, engine: MooncakeEngine, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._engine = engine
        self._slab_nbytes = max(BATCH_NBYTES, self._control.block_nbytes)
        self._lock = threading.Lock()
        self._free = threading.local()                          # this thread's idle slabs
        self._registered: list[np.ndarray] = []                 # every live slab (for close)
        self._quarantined: list[tuple[float, np.ndarray]] = []  # (free after, slab)

    def connect(self, link: PeerLink) -> None:
        """Opens the engine's session to the producer with one small read (once per producer, before
        any request's read)."""
        region = link.regions[0]
        started = self._start_pieces(link, [], [(region.base, min(64, region.part_nbytes))])
        self._wait(link, started)
        self._release(started.slab)

    def _start(self, link: PeerLink, copies: list[Copy]) -> _Started:
        return self._start_pieces(link, copies, [(link.regions[c.layer].base + c.src, c.nbytes) for c in copies])

    def _finish(self, link: PeerLink, started: _Started, digests: np.ndarray | None, options: ReadOptions) -> None:
        self._wait(link, started)
        view = memoryview(started.slab)
        try:
            self._copy_out(started.copies, [(view, offset) for offset in started.offsets], digests, options)
        finally:
            self._release(started.slab)

    def _abandon(self, started: _Started | None) -> None:
        if started is not None:
            self._quarantine(started.slab)

    def _start_pieces(self, link: PeerLink, copies: list[Copy], pieces: Sequence[tuple[int, int]]) -> _Started:
        """Starts reading (remote address, nbytes) pieces back to back into a slab; refuses pieces
        that do not fit one (the engine would write past it, into this process's memory)."""
        offsets = np.cumsum([0] + [nbytes for _, nbytes in pieces]).tolist()
        if offsets[-1] > self._slab_nbytes:
            raise ValueError(f"a Mooncake batch of {offsets[-1]} bytes does not fit a {self._slab_nbytes}-byte slab")
        offsets.pop()
        slab = self._take()
        try:
            batch_ids = self._engine.start_read(link.mooncake_session, [slab.ctypes.data + o for o in offsets],
                                                [address for address, _ in pieces], [n for _, n in pieces])
        except BaseException:
            self._quarantine(slab)
            raise
        return _Started(copies, slab, offsets, batch_ids)

    def _wait(self, link: PeerLink, started: _Started) -> None:
        try:
            self._engine.wait(link.mooncake_session, started.batch_ids, self._engine.timeout_s)
        except BaseException:
            self._quarantine(started.slab)
            raise

    # ---- slabs ----
    def _take(self) -> np.ndarray:
        idle = getattr(self._free, "slabs", None)
        if idle:
            return idle.pop()
        slab = np.empty(self._slab_nbytes, dtype=np.uint8)
        self._engine.register([_region_of(slab)])
        with self._lock:
            self._registered.append(slab)
            self._free_quarantined(time.monotonic())
        return slab

    def _release(self, slab: np.ndarray) -> None:
        if getattr(self._free, "slabs", None) is None:
            self._free.slabs = []
        self._free.slabs.append(slab)

    def _quarantine(self, slab: np.ndarray) -> None:
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

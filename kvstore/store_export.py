"""A node's KV store blocks handed to another node as a KV transfer.

`export` reads the leading held blocks (verified, from whichever tier holds them, with the store's
one batched read per tier) and copies them into an export slab in shared memory, laid out like a KV
cache (layer by layer, so runs of slots move as one copy), and holds them there under an
unguessable transfer id, until the reader releases it or the hold times out. The reader reads them
like a prefill's KV (pdmesh/transport/kv_transport.py): shared memory maps the slab, Mooncake reads
it registered, gRPC streams its rows. The store's own blocks are never pinned by a remote reader.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np

from kvstore.block_key import BlockKey
from kvstore.block_store import TieredBlockStore
from kvstore.shared_slab import SharedSlab
from pdmesh.errors import Overloaded
from pdmesh.kv.kv_layout import LayerRegion, row_checksums, slab_regions
from prefill.kv.held_transfers import HeldTransfer

logger = logging.getLogger(__name__)
ENDED_TTL_S = 300.0  # a released or expired export's id is remembered this long


@dataclass(frozen=True)
class Exported:
    transfer: HeldTransfer | None  # None: the store holds none of the blocks
    tiers: list[str]               # where each exported block came from


class StoreExports:
    def __init__(self, store: TieredBlockStore, pieces: Sequence[tuple[int, int]], capacity_bytes: int,
                 hold_s: float) -> None:
        """pieces: (num_parts, part_nbytes) of each layer, as in the engine's KV cache."""
        self._store = store
        self._pieces = list(pieces)
        self.num_slots = max(1, capacity_bytes // store.block_nbytes)
        self._slab = SharedSlab(self.num_slots, store.block_nbytes, prefix="pdmesh-store-export")
        self._hold_s = hold_s
        self._lock = threading.Lock()
        self._free = np.ones(self.num_slots, dtype=bool)
        self._held: dict[str, HeldTransfer] = {}
        self._leases: dict[str, int] = {}    # transfer id: gRPC pulls streaming it (never expired meanwhile)
        self._ended: dict[str, float] = {}   # released or expired transfer id: forget after this time
        self._buffers = threading.local()  # each server thread's wire rows, reused
        self.num_expired = 0
        flat = self._slab.rows.reshape(-1)
        # (offset of the piece in a block's wire bytes, the slab's (num_slots, part_nbytes) view of it)
        self._pieces_views: list[tuple[int, np.ndarray]] = []
        wire_offset = 0
        for region in self.regions():
            start = region.base - self._slab.address
            for part in range(region.num_parts):
                at = start + part * region.part_stride
                view = flat[at:at + self.num_slots * region.part_nbytes].reshape(self.num_slots, region.part_nbytes)
                self._pieces_views.append((wire_offset, view))
                wire_offset += region.part_nbytes

    def regions(self) -> list[LayerRegion]:
        """The slab, by address in this process (Mooncake)."""
        return slab_regions(self._slab.address, self.num_slots, self._pieces)

    def shared_regions(self) -> list[LayerRegion] | None:
        """The slab, by offset in its shared file (None: not in shared memory)."""
        if self._slab.path is None:
            return None
        return slab_regions(0, self.num_slots, self._pieces, shm_path=str(self._slab.path))

    def registered_region(self) -> LayerRegion:
        """The whole slab as one region (what Mooncake registers)."""
        rows = self._slab.rows
        return LayerRegion(base=self._slab.address, nbytes=rows.nbytes, block_stride=rows.shape[1], part_stride=0,
                           num_parts=1, part_nbytes=rows.shape[1])

    def export(self, keys: Sequence[BlockKey]) -> Exported:
        """Exports the leading blocks of `keys` the store holds; Overloaded when the slab has no
        room for all of `keys` (the caller computes them instead)."""
        if not keys:
            return Exported(None, [])
        slots = self._allocate(len(keys))
        try:
            rows, tiers = self._copy_in(keys, slots)
        except BaseException:
            self._free_slots(slots)
            raise
        num_held = len(tiers)
        self._free_slots(slots[num_held:])
        if not num_held:
            return Exported(None, [])
        kept = slots[:num_held]
        checksums: Future = Future()
        checksums.set_result(row_checksums(rows, self.regions()))
        transfer = HeldTransfer(secrets.token_urlsafe(18), tuple(kept), tuple(k.block_hash for k in keys[:num_held]),
                                deadline=time.monotonic() + self._hold_s, checksums=checksums)
        with self._lock:
            self._held[transfer.transfer_id] = transfer
        return Exported(transfer, tiers)

    def find(self, transfer_id: str) -> HeldTransfer | None:
        self._expire()
        with self._lock:
            return self._held.get(transfer_id)

    def ended(self, transfer_id: str) -> bool:
        """Released or expired lately (a late Open is answered at once, not waited for)."""
        with self._lock:
            return transfer_id in self._ended

    def lease(self, transfer_id: str) -> bool:
        """A reader of the slots right now: the transfer does not expire until unleased. False (no
        lease) when it is no longer held."""
        with self._lock:
            if transfer_id not in self._held:
                return False
            self._leases[transfer_id] = self._leases.get(transfer_id, 0) + 1
            return True

    def unlease(self, transfer_id: str) -> None:
        with self._lock:
            self._leases[transfer_id] -= 1
            if not self._leases[transfer_id]:
                del self._leases[transfer_id]

    def read_rows(self, slots: list[int]) -> np.ndarray:
        """The exported blocks' wire rows ((n, block_nbytes) uint8), gathered from the slab."""
        rows = np.empty((len(slots), self._store.block_nbytes), dtype=np.uint8)
        for wire_offset, view in self._pieces_views:
            rows[:, wire_offset:wire_offset + view.shape[1]] = view[slots]
        return rows

    def release(self, transfer_id: str) -> bool:
        with self._lock:
            transfer = self._held.pop(transfer_id, None)
            if transfer is not None:
                self._ended[transfer_id] = time.monotonic() + ENDED_TTL_S
        if transfer is None:
            return False
        self._free_slots(list(transfer.block_ids))
        return True

    @property
    def num_held(self) -> int:
        self._expire()
        with self._lock:
            return len(self._held)

    def close(self) -> None:
        self._slab.close()

    def _copy_in(self, keys: Sequence[BlockKey], slots: list[int]) -> tuple[np.ndarray, list[str]]:
        """Reads the keys' leading held blocks and copies their pieces into `slots`; (their wire
        rows, their tiers)."""
        rows, tiers = self._store.read_prefix(keys, self._buffer(len(keys)))
        kept = slots[:len(tiers)]
        contiguous = bool(kept) and kept[-1] - kept[0] + 1 == len(kept)
        for wire_offset, view in self._pieces_views:
            pieces = rows[:, wire_offset:wire_offset + view.shape[1]]
            if contiguous:
                view[kept[0]:kept[-1] + 1] = pieces
            else:
                view[kept] = pieces
        return rows, tiers

    def _buffer(self, num_blocks: int) -> np.ndarray:
        """This thread's wire-row buffer, grown as needed (fresh pages would fault in every export)."""
        buffer = getattr(self._buffers, "rows", None)
        if buffer is None or len(buffer) < num_blocks:
            buffer = self._buffers.rows = np.empty((num_blocks, self._store.block_nbytes), dtype=np.uint8)
        return buffer

    def _allocate(self, num_blocks: int) -> list[int]:
        """Free slots for num_blocks, a contiguous run where there is one."""
        self._expire()
        with self._lock:
            free = np.flatnonzero(self._free)
            if len(free) < num_blocks:
                raise Overloaded(f"the KV store's export slab has {len(free)} free blocks, {num_blocks} asked")
            runs = np.flatnonzero(free[num_blocks - 1:] - free[:len(free) - num_blocks + 1] == num_blocks - 1)
            slots = (list(range(free[runs[0]], free[runs[0]] + num_blocks)) if len(runs)
                     else free[:num_blocks].tolist())
            self._free[slots] = False
            return slots

    def _free_slots(self, slots: list[int]) -> None:
        with self._lock:
            self._free[slots] = True

    def _expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            expired = [tid for tid, transfer in self._held.items()
                       if transfer.deadline <= now and tid not in self._leases]
            for transfer_id in expired:
                self._free[list(self._held.pop(transfer_id).block_ids)] = True
                self._ended[transfer_id] = now + ENDED_TTL_S
            self.num_expired += len(expired)
            for transfer_id in [tid for tid, until in self._ended.items() if until <= now]:
                del self._ended[transfer_id]
        if expired:
            logger.warning("%d KV store exports were not released within %.0f s: freed", len(expired), self._hold_s)

"""A content-addressed block store over tiers (device → DRAM → NVMe), thread-safe.

Placement: a new block goes to the first tier; when a tier is full, its least recently used
block that nobody is reading moves one tier down (from the last tier it is dropped); a hit in a
lower tier promotes the block to the first tier. Lookups touch a prefix's blocks from its tail
to its head, so within one prefix the tail is older and is demoted first: a prefix loses its
end before its start, and what stays is still a usable prefix.

Integrity: each block's xxh3-64 is kept beside it and checked on every read; a block that fails
is dropped and counted, and the read is a miss. A block being read is pinned and never moved
or freed under its reader. Out of space (every slot pinned) is a `False`, not an exception.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from kvstore.block_key import BlockKey
from kvstore.store_events import BlockDropped, BlockPlaced, StoreEvent, StoreListener
from kvstore.tier import BlockTier, Payload
from pdmesh.transport.checksum import block_checksum

logger = logging.getLogger(__name__)


@dataclass
class _Entry:
    key: BlockKey
    tier: int
    handle: object
    checksum: int
    num_readers: int = 0


class TieredBlockStore:
    def __init__(self, tiers: Sequence[BlockTier], block_nbytes: int, listener: StoreListener | None = None) -> None:
        if not tiers:
            raise ValueError("a block store needs at least one tier")
        self._tiers = list(tiers)
        self.block_nbytes = block_nbytes
        self._listener = listener
        self._lock = threading.Lock()
        self._entries: dict[bytes, _Entry] = {}
        self._lru: list[OrderedDict[bytes, None]] = [OrderedDict() for _ in self._tiers]
        self.hits: Counter[str] = Counter()        # blocks read, by tier
        self.corrupt: Counter[str] = Counter()     # blocks that failed their checksum, by tier
        self.num_dropped = 0                       # evicted from the last tier
        self._recover()

    @property
    def tier_names(self) -> list[str]:
        return [tier.name for tier in self._tiers]

    def set_listener(self, listener: StoreListener | None) -> None:
        self._listener = listener

    # ---- queries ----
    def longest_prefix(self, keys: Sequence[BlockKey]) -> int:
        """How many leading keys the store holds (guard included); touches them tail first."""
        with self._lock:
            num_hits = 0
            for key in keys:
                entry = self._entries.get(key.block_hash)
                if entry is None or entry.key != key:
                    break
                num_hits += 1
            for key in reversed(keys[:num_hits]):
                self._lru[self._entries[key.block_hash].tier].move_to_end(key.block_hash)
        return num_hits

    def has(self, key: BlockKey) -> bool:
        """Held (guard included); touches it."""
        with self._lock:
            entry = self._entries.get(key.block_hash)
            if entry is None or entry.key != key:
                return False
            self._lru[entry.tier].move_to_end(key.block_hash)
            return True

    @property
    def num_pinned(self) -> int:
        """Blocks a reader holds right now (0 whenever the store is idle)."""
        with self._lock:
            return sum(1 for entry in self._entries.values() if entry.num_readers > 0)

    def announce_all(self) -> None:
        """Tells the listener about every block held (after a restart recovered NVMe blocks)."""
        with self._lock:
            events: list[StoreEvent] = [
                BlockPlaced(h, self._tiers[e.tier].name, self.block_nbytes, e.checksum) for h, e in self._entries.items()]
        self._emit(events)

    def tier_of(self, block_hash: bytes) -> str | None:
        with self._lock:
            entry = self._entries.get(block_hash)
            return None if entry is None else self._tiers[entry.tier].name

    def blocks_in(self, tier_name: str) -> list[bytes]:
        """Hashes held in one tier, least recently used first."""
        with self._lock:
            return list(self._lru[self.tier_names.index(tier_name)])

    def occupancy_bytes(self) -> dict[str, int]:
        with self._lock:
            return {tier.name: len(lru) * self.block_nbytes for tier, lru in zip(self._tiers, self._lru)}

    @property
    def num_blocks(self) -> int:
        with self._lock:
            return len(self._entries)

    # ---- writes ----
    def put(self, key: BlockKey, payload: Payload) -> bool:
        """Stores a block in the first tier (True), or keeps the copy it has; False when out of space."""
        events: list[StoreEvent] = []
        with self._lock:
            entry = self._entries.get(key.block_hash)
            if entry is not None:
                if entry.key != key:
                    logger.error("hash collision on %s: keeping the stored block", key.block_hash.hex())
                    return False
                self._lru[entry.tier].move_to_end(key.block_hash)
                return True
            if not self._make_room(0, events):
                return False
            checksum = block_checksum(payload)
            handle = self._tiers[0].write(key, payload, checksum)
            self._entries[key.block_hash] = _Entry(key, 0, handle, checksum)
            self._lru[0][key.block_hash] = None
            events.append(BlockPlaced(key.block_hash, self._tiers[0].name, len(payload), checksum))
        self._emit(events)
        return True

    def read(self, key: BlockKey) -> tuple[memoryview, str] | None:
        """(payload, tier it came from), verified; None on a miss or a corrupt block. Promotes a hit."""
        with self._lock:
            entry = self._entries.get(key.block_hash)
            if entry is None or entry.key != key:
                return None
            entry.num_readers += 1
            tier = entry.tier
        payload = self._read_unlocked(entry, tier)
        events: list[StoreEvent] = []
        with self._lock:
            entry.num_readers -= 1
            tier_name = self._tiers[tier].name
            if payload is None or block_checksum(payload) != entry.checksum:
                self.corrupt[tier_name] += 1
                logger.warning("block %s in %s failed its checksum: dropped", key.block_hash.hex(), tier_name)
                self._drop(key.block_hash, events)
                payload = None
            else:
                self.hits[tier_name] += 1
                self._promote(entry, payload, events)
        self._emit(events)
        return None if payload is None else (payload, tier_name)

    def spill(self, to_tier: str) -> int:
        """Moves every unpinned block above `to_tier` down into it (operators: drain before a
        restart; tests: force blocks onto NVMe). Returns how many moved."""
        target = self.tier_names.index(to_tier)
        events: list[StoreEvent] = []
        num_moved = 0
        with self._lock:
            for tier in range(target - 1, -1, -1):
                for block_hash in list(self._lru[tier]):
                    entry = self._entries[block_hash]
                    if entry.num_readers > 0 or not self._make_room(target, events):
                        continue
                    self._move(entry, target, events)
                    num_moved += 1
        self._emit(events)
        return num_moved

    def clear(self) -> None:
        events: list[StoreEvent] = []
        with self._lock:
            for block_hash in [h for h, e in self._entries.items() if e.num_readers == 0]:
                self._drop(block_hash, events)
        self._emit(events)

    # ---- internals (lock held) ----
    def _read_unlocked(self, entry: _Entry, tier: int) -> memoryview | None:
        try:
            return self._tiers[tier].read(entry.handle)
        except (OSError, ValueError) as exc:
            logger.warning("reading block %s from %s failed: %s", entry.key.block_hash.hex(),
                           self._tiers[tier].name, exc)
            return None

    def _make_room(self, tier: int, events: list[StoreEvent]) -> bool:
        while self._tiers[tier].num_free <= 0:
            victim = next((h for h in self._lru[tier] if self._entries[h].num_readers == 0), None)
            if victim is None:
                return False
            entry = self._entries[victim]
            if tier + 1 < len(self._tiers):
                entry.num_readers += 1  # pinned while the tier below makes room (it may evict too)
                has_room = self._make_room(tier + 1, events)
                entry.num_readers -= 1
                if has_room:
                    self._move(entry, tier + 1, events)
                    continue
            self._drop(victim, events)
            self.num_dropped += 1
        return True

    def _move(self, entry: _Entry, to_tier: int, events: list[StoreEvent]) -> None:
        payload = self._tiers[entry.tier].read(entry.handle)
        self._relocate(entry, to_tier, payload, events)

    def _relocate(self, entry: _Entry, to_tier: int, payload: Payload, events: list[StoreEvent]) -> None:
        block_hash = entry.key.block_hash
        new_handle = self._tiers[to_tier].write(entry.key, payload, entry.checksum)
        self._tiers[entry.tier].free(entry.handle)
        del self._lru[entry.tier][block_hash]
        entry.tier, entry.handle = to_tier, new_handle
        self._lru[to_tier][block_hash] = None
        events.append(BlockPlaced(block_hash, self._tiers[to_tier].name, len(payload), entry.checksum))

    def _promote(self, entry: _Entry, payload: memoryview, events: list[StoreEvent]) -> None:
        """Moves a hit to the first tier. Its old slot is freed first (the payload is in hand), so
        the blocks it displaces can move down into the room it leaves."""
        block_hash = entry.key.block_hash
        if self._entries.get(block_hash) is not entry:
            return
        if entry.tier == 0 or entry.num_readers > 0:
            self._lru[entry.tier].move_to_end(block_hash)
            return
        old_tier = entry.tier
        self._tiers[old_tier].free(entry.handle)
        del self._lru[old_tier][block_hash]
        # Detached from every LRU list, the entry cannot be picked as a victim while room is made.
        # A failed _make_room moved nothing, so the slot just freed is still there to go back to.
        to_tier = 0 if self._make_room(0, events) else old_tier
        entry.tier, entry.handle = to_tier, self._tiers[to_tier].write(entry.key, payload, entry.checksum)
        self._lru[to_tier][block_hash] = None
        if to_tier != old_tier:
            events.append(BlockPlaced(block_hash, self._tiers[to_tier].name, len(payload), entry.checksum))

    def _drop(self, block_hash: bytes, events: list[StoreEvent]) -> None:
        entry = self._entries.pop(block_hash, None)
        if entry is None:
            return
        self._tiers[entry.tier].free(entry.handle)
        del self._lru[entry.tier][block_hash]
        events.append(BlockDropped(block_hash))

    def _recover(self) -> None:
        for index, tier in enumerate(self._tiers):
            for key, handle, checksum in tier.recovered():
                self._entries[key.block_hash] = _Entry(key, index, handle, checksum)
                self._lru[index][key.block_hash] = None

    def _emit(self, events: list[StoreEvent]) -> None:
        if events and self._listener is not None:
            try:
                self._listener.on_events(events)
            except Exception:  # noqa: BLE001 - the index is a cache; the store stays the truth
                logger.warning("store listener failed", exc_info=True)

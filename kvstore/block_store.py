"""A content-addressed block store over tiers (device → DRAM → NVMe), thread-safe.

Placement: a new block goes to the first tier; when a tier is full, its least recently used
block that nobody is reading moves one tier down (from the last tier it is dropped); a hit in a
lower tier promotes the block to the first tier. Lookups, puts and reads touch a prefix's blocks
from its tail to its head, so within one prefix the tail is older and is demoted first: a prefix
loses its end before its start, and what stays is still a usable prefix.

Batches: `put_many` and `read_prefix` move n blocks with one copy per tier (a gather or scatter
over a slab, a vectored write and one fsync on disk), and demotions triggered by one call move
together. Memory tiers are written under the lock (a memcpy); a slow tier (disk) is written
after the lock is released: its blocks are pinned meanwhile and read from the rows in hand, so
no lookup, put or read ever waits on an fsync.

Integrity: each block's checksum (pdmesh/kv/checksum.py) is kept beside it and checked on every
read; a block that fails is dropped and counted, and the read is a miss. A block being read or
written is pinned and never moved or freed under its reader. Out of space (every slot pinned) is
a `False`, not an exception.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import islice

import numpy as np

from kvstore.block_key import BlockKey
from kvstore.store_events import BlockDropped, BlockPlaced, StoreEvent, StoreListener
from kvstore.tier import BlockTier, Payload
from kvstore.tier_io import SlowWrite, Work, as_rows, read_placed
from pdmesh.kv.checksum import block_checksum

logger = logging.getLogger(__name__)


@dataclass
class _Entry:
    key: BlockKey
    tier: int
    handle: object
    checksum: int
    num_readers: int = 0
    pending: np.ndarray | None = None  # its payload while a slow tier writes it (pinned meanwhile)


class TieredBlockStore:
    def __init__(self, tiers: Sequence[BlockTier], block_nbytes: int, listener: StoreListener | None = None,
                 piece_nbytes: Sequence[int] | None = None) -> None:
        """piece_nbytes: the blocks' pieces, which their checksums cover (None: one piece)."""
        if not tiers:
            raise ValueError("a block store needs at least one tier")
        self._tiers = list(tiers)
        self.block_nbytes = block_nbytes
        self._piece_nbytes = piece_nbytes
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
        return self.put_many([key], as_rows([payload], self.block_nbytes)) == 1

    def put_many(self, keys: Sequence[BlockKey], rows: np.ndarray) -> int:
        """Stores row i of `rows` ((n, block_nbytes) uint8) under keys[i] in the first tier, keeping
        the copies it has. Returns how many leading keys it holds now: it stops at a hash collision
        or when out of space (every slot pinned)."""
        rows = as_rows(rows, self.block_nbytes)
        checksums = [block_checksum(row, self._piece_nbytes) for row in rows]
        work = Work()
        with self._lock:
            num_held, new = len(keys), []
            for i, key in enumerate(keys):
                entry = self._entries.get(key.block_hash)
                if entry is None:
                    new.append(i)
                elif entry.key != key:
                    logger.error("hash collision on %s: keeping the stored block", key.block_hash.hex())
                    num_held = i
                    break
                else:
                    self._lru[entry.tier].move_to_end(key.block_hash)
            entries = [_Entry(keys[i], 0, None, checksums[i]) for i in new]
            new_rows = rows[new[0]:new[-1] + 1] if new and new[-1] - new[0] + 1 == len(new) else rows[new]  # a view
            num_admitted = self._admit(0, entries, new_rows, work)
            if num_admitted < len(new):
                num_held = min(num_held, new[num_admitted])
            self._touch_tail_first(keys[:num_held])
        self._finish(work)
        return num_held

    def read(self, key: BlockKey) -> tuple[memoryview, str] | None:
        """(payload, tier it came from), verified; None on a miss or a corrupt block. Promotes a hit."""
        rows, tiers = self.read_prefix([key])
        return (memoryview(rows[0]), tiers[0]) if tiers else None

    def read_prefix(self, keys: Sequence[BlockKey], out: np.ndarray | None = None) -> tuple[np.ndarray, list[str]]:
        """(rows, tiers) of the leading keys held and verified: row i is keys[i]'s payload, read
        with one batched copy per tier into `out` (a reused (>= len(keys), block_nbytes) uint8
        buffer saves faulting in fresh pages) or a new array; stops at the first miss or corrupt
        block (dropped and counted). Promotes the hits to the first tier."""
        with self._lock:
            entries = []
            for key in keys:
                entry = self._entries.get(key.block_hash)
                if entry is None or entry.key != key:
                    break
                entry.num_readers += 1
                entries.append(entry)
            placed = [(entry.tier, entry.handle, entry.pending) for entry in entries]
        rows = np.empty((len(entries), self.block_nbytes), dtype=np.uint8) if out is None else out[:len(entries)]
        readable = read_placed(self._tiers, placed, rows)
        intact = [ok and block_checksum(row, self._piece_nbytes) == entry.checksum
                  for ok, row, entry in zip(readable, rows, entries)]
        num_good = intact.index(False) if False in intact else len(entries)
        work = Work()
        with self._lock:
            for entry in entries:
                entry.num_readers -= 1
            for entry, (tier, _, _), ok in zip(entries, placed, intact):
                if not ok:
                    self.corrupt[self._tiers[tier].name] += 1
                    logger.warning("block %s in %s failed its checksum: dropped", entry.key.block_hash.hex(),
                                   self._tiers[tier].name)
                    if self._entries.get(entry.key.block_hash) is entry:
                        self._drop(entry.key.block_hash, work.events)
            tiers = [self._tiers[tier].name for tier, _, _ in placed[:num_good]]
            self.hits.update(tiers)
            self._promote(entries[:num_good], rows[:num_good], work)
            self._touch_tail_first([entry.key for entry in entries[:num_good]])
        self._finish(work)
        return rows[:num_good], tiers

    def spill(self, to_tier: str) -> int:
        """Moves every unpinned block above `to_tier` down into it (operators: drain before a
        restart; tests: force blocks onto NVMe). Returns how many moved."""
        target = self.tier_names.index(to_tier)
        work = Work()
        num_moved = 0
        with self._lock:
            for tier in range(target - 1, -1, -1):
                movable = [self._entries[h] for h in self._lru[tier] if self._entries[h].num_readers == 0]
                room = self._make_room(target, len(movable), work)
                self._move(movable[:room], target, work)
                num_moved += room
        self._finish(work)
        return num_moved

    def clear(self) -> None:
        events: list[StoreEvent] = []
        with self._lock:
            for block_hash in [h for h, e in self._entries.items() if e.num_readers == 0]:
                self._drop(block_hash, events)
        self._emit(events)

    def close(self) -> None:
        """Closes the tiers that hold files: the NVMe tier's directory is free for the next store."""
        for tier in self._tiers:
            close = getattr(tier, "close", None)
            if close is not None:
                close()

    # ---- internals (lock held) ----
    def _admit(self, tier: int, entries: list[_Entry], rows: np.ndarray, work: Work) -> int:
        """Places new blocks as if put one by one: a batch larger than the tier puts its oldest
        blocks straight into the tier below. Returns how many leading blocks were placed."""
        overflow = len(entries) - self._tiers[tier].capacity_blocks if tier + 1 < len(self._tiers) else 0
        num_below = self._admit(tier + 1, entries[:overflow], rows[:overflow], work) if overflow > 0 else 0
        overflow = max(overflow, 0)
        room = self._make_room(tier, len(entries) - overflow, work)
        self._place(tier, entries[overflow:overflow + room], rows[overflow:overflow + room], work)
        return num_below if num_below < overflow else overflow + room

    def _make_room(self, tier: int, num_needed: int, work: Work) -> int:
        """Frees slots in `tier` for up to `num_needed` blocks by moving its least recently used
        unpinned blocks one tier down, together (dropping them from the last tier); returns how
        many it has room for."""
        shortfall = num_needed - self._tiers[tier].num_free
        if shortfall > 0:
            unpinned = (self._entries[h] for h in self._lru[tier] if self._entries[h].num_readers == 0)
            victims = list(islice(unpinned, shortfall))
            if victims and tier + 1 < len(self._tiers):
                for victim in victims:
                    victim.num_readers += 1  # pinned while the tier below makes room (it may evict too)
                try:
                    room = self._make_room(tier + 1, len(victims), work)
                finally:
                    for victim in victims:
                        victim.num_readers -= 1
                self._move(victims[:room], tier + 1, work)
                victims = victims[room:]
            for victim in victims:
                self._drop(victim.key.block_hash, work.events)
                self.num_dropped += 1
        return min(num_needed, self._tiers[tier].num_free)

    def _move(self, entries: list[_Entry], to_tier: int, work: Work) -> None:
        """Moves blocks (room made) into `to_tier` with one read per source tier and one write."""
        if not entries:
            return
        rows = np.empty((len(entries), self.block_nbytes), dtype=np.uint8)
        readable = read_placed(self._tiers, [(e.tier, e.handle, e.pending) for e in entries], rows)
        for entry in entries:
            self._detach(entry)
        moving = [i for i, ok in enumerate(readable) if ok]
        for entry in (entries[i] for i, ok in enumerate(readable) if not ok):  # unreadable: nothing to move
            self._forget(entry, work.events)
        self._place(to_tier, [entries[i] for i in moving], rows[moving], work)

    def _promote(self, entries: list[_Entry], rows: np.ndarray, work: Work) -> None:
        """Moves verified hits to the first tier with one write. Their old slots are freed first
        (the payloads are in hand), so the blocks they displace can move down into that room."""
        movers = []
        for entry, row in zip(entries, rows):
            if self._entries.get(entry.key.block_hash) is not entry:
                continue
            if entry.tier == 0 or entry.num_readers > 0:
                self._lru[entry.tier].move_to_end(entry.key.block_hash)
            else:
                movers.append((entry, row))
        if not movers:
            return
        old_tiers = [entry.tier for entry, _ in movers]
        for entry, _ in movers:
            self._detach(entry)  # off every LRU list: never a victim while room is made
        room = self._make_room(0, len(movers), work)
        self._place(0, [entry for entry, _ in movers[:room]], np.stack([row for _, row in movers[:room]])
                    if room else rows[:0], work)
        for (entry, row), old_tier in zip(movers[room:], old_tiers[room:]):  # no room above: back where it was
            if self._make_room(old_tier, 1, work):
                self._place(old_tier, [entry], row[None], work)
            else:
                self._forget(entry, work.events)

    def _touch_tail_first(self, keys: Sequence[BlockKey]) -> None:
        """Makes a prefix's held blocks the most recently used, its head the most recent of all."""
        for key in reversed(keys):
            entry = self._entries.get(key.block_hash)
            if entry is not None and entry.key == key and key.block_hash in self._lru[entry.tier]:
                self._lru[entry.tier].move_to_end(key.block_hash)

    def _place(self, tier: int, entries: list[_Entry], rows: np.ndarray, work: Work) -> None:
        """Puts blocks (room made) into `tier`: written now in memory, after the lock on disk."""
        if not entries:
            return
        handles = self._tiers[tier].allocate(len(entries))
        for entry, handle in zip(entries, handles):
            entry.tier, entry.handle = tier, handle
            self._entries[entry.key.block_hash] = entry
            self._lru[tier][entry.key.block_hash] = None
            work.events.append(BlockPlaced(entry.key.block_hash, self._tiers[tier].name, self.block_nbytes,
                                           entry.checksum))
        if self._tiers[tier].slow:
            rows = np.array(rows, copy=True)  # the caller's rows may change before the write
            for entry, row in zip(entries, rows):
                entry.pending = row
                entry.num_readers += 1
            work.slow_writes.append(SlowWrite(tier, entries, rows))
        else:
            self._tiers[tier].write_many(handles, [e.key for e in entries], rows, [e.checksum for e in entries])

    def _detach(self, entry: _Entry) -> None:
        """Frees the entry's slot and takes it off its LRU list (it stays in the map)."""
        self._tiers[entry.tier].free(entry.handle)
        del self._lru[entry.tier][entry.key.block_hash]

    def _drop(self, block_hash: bytes, events: list[StoreEvent]) -> None:
        entry = self._entries.get(block_hash)
        if entry is None:
            return
        self._detach(entry)
        self._forget(entry, events)

    def _forget(self, entry: _Entry, events: list[StoreEvent]) -> None:
        """Takes a detached entry out of the store and says so."""
        del self._entries[entry.key.block_hash]
        events.append(BlockDropped(entry.key.block_hash))

    def _recover(self) -> None:
        for index, tier in enumerate(self._tiers):
            for key, handle, checksum in tier.recovered():
                self._entries[key.block_hash] = _Entry(key, index, handle, checksum)
                self._lru[index][key.block_hash] = None

    # ---- without the lock ----
    def _finish(self, work: Work) -> None:
        """Writes the slow tiers' batches, unpins them (dropping what failed to write), then tells
        the listener."""
        for batch in work.slow_writes:
            entries = batch.entries
            try:
                self._tiers[batch.tier].write_many([e.handle for e in entries], [e.key for e in entries],
                                                   batch.rows, [e.checksum for e in entries])
                failed = False
            except OSError as exc:
                logger.warning("writing %d blocks to %s failed: %s; dropped", len(entries),
                               self._tiers[batch.tier].name, exc)
                failed = True
            with self._lock:
                for entry in entries:
                    entry.pending = None
                    entry.num_readers -= 1
                    if failed and self._entries.get(entry.key.block_hash) is entry:
                        self._drop(entry.key.block_hash, work.events)
                        self.num_dropped += 1
        self._emit(work.events)

    def _emit(self, events: list[StoreEvent]) -> None:
        if events and self._listener is not None:
            try:
                self._listener.on_events(events)
            except Exception:  # noqa: BLE001 - the index is a cache; the store stays the truth
                logger.warning("store listener failed", exc_info=True)

"""What one storage tier of the block store does; the store decides what goes where.

Tiers move blocks in batches: `write_many` / `read_many` take a (n, block_nbytes) uint8 array,
so n blocks cost one large copy (or one vectored write and one fsync), not n small ones.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Sequence
from typing import Protocol

import numpy as np

from kvstore.block_key import BlockKey

Payload = bytes | bytearray | memoryview


class BlockTier(Protocol):
    """Fixed-size slots for block payloads. `allocate` and `free` are called under the store's
    lock; `write_many` and `read_many` may run outside it, concurrently, on distinct slots (the
    store never frees a slot while it is being written or read)."""

    name: str
    capacity_blocks: int
    slow: bool  # the store writes this tier outside its lock (disk), not inside (memory)

    @property
    def num_free(self) -> int:
        ...

    def allocate(self, num_blocks: int) -> list[object]:
        """Handles of `num_blocks` free slots (the caller made sure there are that many)."""

    def write_many(self, handles: Sequence[object], keys: Sequence[BlockKey], rows: np.ndarray,
                   checksums: Sequence[int]) -> None:
        """Row i of `rows` into handles[i]; durable (where the tier is) when it returns."""

    def read_many(self, handles: Sequence[object], out: np.ndarray) -> None:
        """Payload of handles[i] into out[i] (may be corrupt: the store verifies the checksum);
        OSError / ValueError when the medium fails."""

    def free(self, handle: object) -> None:
        ...

    def recovered(self) -> Iterator[tuple[BlockKey, object, int]]:
        """Blocks that survived a restart, as (key, handle, checksum): only persistent tiers have any."""


def contiguous_runs(handles: Sequence[int]) -> Iterator[tuple[int, int, int]]:
    """(first position, first handle, length) of each run of consecutive integer handles, so a
    batch costs one copy or one vectored I/O call per run."""
    start = 0
    for i in range(1, len(handles) + 1):
        if i == len(handles) or handles[i] != handles[i - 1] + 1:
            yield start, handles[start], i - start
            start = i


class FreeSlots:
    """A tier's free slot numbers; hands out the lowest first (pop from the end of a descending list)."""

    def __init__(self, tier_name: str, capacity_blocks: int, used: Collection[int] = ()) -> None:
        self._tier_name = tier_name
        self._free = [slot for slot in range(capacity_blocks - 1, -1, -1) if slot not in used]

    def __len__(self) -> int:
        return len(self._free)

    def take(self, num_blocks: int) -> list[int]:
        if num_blocks > len(self._free):
            raise ValueError(f"{self._tier_name}: {num_blocks} slots asked, {len(self._free)} free")
        return [self._free.pop() for _ in range(num_blocks)]

    def give_back(self, slot: int) -> None:
        self._free.append(slot)


def check_rows(tier_name: str, rows: np.ndarray, num_blocks: int, block_nbytes: int) -> None:
    """A write's rows must be one whole slot each."""
    if rows.shape != (num_blocks, block_nbytes):
        raise ValueError(f"{tier_name}: rows of shape {rows.shape} for {num_blocks} slots of {block_nbytes} bytes")

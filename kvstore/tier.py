"""What one storage tier of the block store does; the store decides what goes where."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from kvstore.block_key import BlockKey

Payload = bytes | bytearray | memoryview


class BlockTier(Protocol):
    """Fixed-size slots for block payloads. Not thread-safe: the store serializes writes and
    frees, and never frees a slot while a reader holds it."""

    name: str
    capacity_blocks: int

    @property
    def num_free(self) -> int:
        ...

    def write(self, key: BlockKey, payload: Payload, checksum: int) -> object:
        """Stores the payload in a free slot (the caller made sure there is one); returns its handle."""

    def read(self, handle: object) -> memoryview:
        """A copy of the payload (may be corrupt: the store verifies the checksum)."""

    def free(self, handle: object) -> None:
        ...

    def recovered(self) -> Iterator[tuple[BlockKey, object, int]]:
        """Blocks that survived a restart, as (key, handle, checksum): only persistent tiers have any."""

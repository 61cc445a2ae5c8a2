"""What changed in a store, handed to its listener (the Redis index) after the store's lock is
released, so no network call ever runs under it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class BlockPlaced:
    """A block is now held in `tier` (new, demoted or promoted)."""

    block_hash: bytes
    tier: str
    nbytes: int
    checksum: int


@dataclass(frozen=True)
class BlockDropped:
    """A block left the store (evicted from the last tier, or found corrupt)."""

    block_hash: bytes


StoreEvent = BlockPlaced | BlockDropped


class StoreListener(Protocol):
    def on_events(self, events: list[StoreEvent]) -> None:
        ...

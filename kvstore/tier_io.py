"""Batched I/O over a store's tiers, outside the store's lock: one read per tier for a batch of
blocks, the writes to slow tiers a call left for after the lock, and the rows a batch is given as."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvstore.store_events import StoreEvent
from kvstore.tier import BlockTier

logger = logging.getLogger(__name__)


@dataclass
class SlowWrite:
    """Blocks placed in a slow tier under the lock, to be written once it is released."""

    tier: int
    entries: list      # the store's entries of the blocks, pinned until written
    rows: np.ndarray


@dataclass
class Work:
    """What one call changed under the lock, handled after it is released."""

    events: list[StoreEvent] = field(default_factory=list)
    slow_writes: list[SlowWrite] = field(default_factory=list)


def read_placed(tiers: Sequence[BlockTier], placed: list[tuple[int, object, np.ndarray | None]],
                out: np.ndarray) -> list[bool]:
    """Reads (tier, handle, pending row) i into out[i], one batched read per tier; False where
    the medium failed."""
    readable = [True] * len(placed)
    by_tier: dict[int, list[int]] = {}
    for i, (tier, _, pending) in enumerate(placed):
        if pending is not None:
            out[i] = pending
        else:
            by_tier.setdefault(tier, []).append(i)
    for tier, positions in by_tier.items():
        handles = [placed[i][1] for i in positions]
        contiguous = positions[-1] - positions[0] + 1 == len(positions)
        dest = out[positions[0]:positions[-1] + 1] if contiguous else np.empty((len(positions), out.shape[1]),
                                                                                dtype=np.uint8)
        try:
            tiers[tier].read_many(handles, dest)
        except (OSError, ValueError) as exc:
            logger.warning("reading %d blocks from %s failed: %s", len(handles), tiers[tier].name, exc)
            for i in positions:
                readable[i] = False
            continue
        if not contiguous:
            out[positions] = dest
    return readable


def as_rows(rows, block_nbytes: int) -> np.ndarray:
    """A (n, block_nbytes) uint8 array over `rows` (an array, or a list of payloads)."""
    if not isinstance(rows, np.ndarray):
        rows = np.stack([np.frombuffer(p, dtype=np.uint8) for p in rows]) if rows else np.empty((0, block_nbytes),
                                                                                                 dtype=np.uint8)
    if rows.ndim != 2 or rows.shape[1] != block_nbytes or rows.dtype != np.uint8:
        raise ValueError(f"payload rows of shape {rows.shape} and {rows.dtype}, blocks are {block_nbytes} bytes")
    return rows

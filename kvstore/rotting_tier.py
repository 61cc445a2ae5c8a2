"""Fault injection for the tests and the fault benchmark (off in any real deployment): a tier that
keeps every block written into it with one bit flipped, after the store took the block's checksum
— a block rotting at rest in device memory, DRAM or on disk. The store must catch it on the read
(checksum), drop it and count it; the prompt is then computed."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvstore.block_key import BlockKey
from kvstore.tier import BlockTier

ROT_MASK = 0x10


class RottingTier:
    def __init__(self, tier: BlockTier, rot_offset: int) -> None:
        """rot_offset: the byte of each block that rots (tiers rotting in a chain use distinct ones,
        so that a block demoted from one into the next is not flipped back)."""
        self._tier = tier
        self._rot_offset = rot_offset

    def __getattr__(self, name: str):
        return getattr(self._tier, name)

    def write_many(self, handles: Sequence[object], keys: Sequence[BlockKey], rows: np.ndarray,
                   checksums: Sequence[int]) -> None:
        rotten = np.array(rows, copy=True)
        rotten[:, self._rot_offset] ^= ROT_MASK
        self._tier.write_many(handles, keys, rotten, checksums)

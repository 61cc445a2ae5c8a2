"""What names a stored block and what guards a hit against a hash collision.

A block is named by its chained content hash (`block_hash.hash_block`); a hit also compares
the parent hash and the block's own token ids with the ones stored beside it, so two
prefixes can only share a block if they really hold the same tokens after the same parent.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvstore.block_hash import ROOT_PARENT, hash_block


@dataclass(frozen=True)
class BlockKey:
    block_hash: bytes
    parent_hash: bytes
    token_ids: tuple[int, ...]

    def guard_bytes(self) -> bytes:
        """Parent hash and token ids as stored next to the block (int32 little-endian)."""
        return self.parent_hash + np.asarray(self.token_ids, dtype="<i4").tobytes()


def block_keys(seed: bytes, token_ids: Sequence[int], block_size: int, extra_key: bytes = b"") -> list[BlockKey]:
    """Keys of the full blocks of `token_ids` (a trailing partial block has none)."""
    keys: list[BlockKey] = []
    parent = ROOT_PARENT
    for start in range(0, len(token_ids) - len(token_ids) % block_size, block_size):
        tokens = tuple(int(t) for t in token_ids[start:start + block_size])
        block_hash = hash_block(seed, parent, tokens, extra_key)
        keys.append(BlockKey(block_hash, parent, tokens))
        parent = block_hash
    return keys

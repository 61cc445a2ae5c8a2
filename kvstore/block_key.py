"""What names a stored block and what guards a hit against a hash collision.

A block is named by its chained content hash (`block_hash.hash_block`); a hit also compares
the parent hash and the block's own token ids with the ones stored beside it, so two
prefixes can only share a block if they really hold the same tokens after the same parent.
The cache salt is in the name only: two tenants' equal prompts are kept apart by their names
alone, SHA-256 so that no crafted prompt shares one (pdmesh/kv/block_hash.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pdmesh.kv.block_hash import ROOT_PARENT, chain_block_hashes


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
    return keys_of(chain_block_hashes(seed, token_ids, block_size, extra_key), token_ids, block_size)


def keys_of(block_hashes: Sequence[bytes], token_ids: Sequence[int], block_size: int) -> list[BlockKey]:
    """The keys of the full blocks whose chained hashes are already computed (chain_block_hashes: the
    one function that hashes blocks, shared by the KV transfer and the store)."""
    num_full = min(len(block_hashes), len(token_ids) // block_size)
    parents = [ROOT_PARENT, *block_hashes[:num_full - 1]] if num_full else []
    return [BlockKey(block_hashes[i], parents[i], tuple(int(t) for t in token_ids[i * block_size:(i + 1) * block_size]))
            for i in range(num_full)]

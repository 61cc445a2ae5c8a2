"""What the shared index knows about a prompt, in the store's own key scheme: for each leading full
block, the node holding a copy. For readers outside a worker (the gateway's prefix-aware routing):
no store, no torch."""

from __future__ import annotations

from collections.abc import Sequence

from kvstore.redis_index import RedisBlockIndex
from pdmesh.kv.block_hash import chain_block_hashes, salt_extra_key


def prompt_holders(index: RedisBlockIndex, seed: bytes, token_ids: Sequence[int], block_size: int,
                   cache_salt: str) -> list[str]:
    """The node holding each block of the longest indexed prefix of `token_ids` (one Redis round trip)."""
    hashes = chain_block_hashes(seed, token_ids, block_size, salt_extra_key(cache_salt))
    holders = []
    for entry in index.probe(hashes) if hashes else []:
        if entry is None:
            break
        holders.append(entry.node)
    return holders

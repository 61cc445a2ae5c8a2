"""What the shared index knows about a prompt, in the store's own key scheme: for each leading full
block, the node holding a copy. For readers outside a worker (the gateway's prefix-aware routing):
no store, no torch."""

from __future__ import annotations

from collections.abc import Sequence

from kvstore.redis_index import RedisBlockIndex


def prompt_holders(index: RedisBlockIndex, block_hashes: Sequence[bytes]) -> list[str]:
    """The node holding each block of the longest indexed prefix of the prompt whose full blocks are
    named `block_hashes` (pdmesh/kv/block_hash.py), in one Redis round trip."""
    holders = []
    for entry in index.probe(block_hashes) if block_hashes else []:
        if entry is None:
            break
        holders.append(entry.node)
    return holders

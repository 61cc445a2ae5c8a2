"""Finds the longest cached prefix of a request: local tiers first, then other nodes through the
shared index (one Redis round trip for all the blocks past the local hit)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvstore.block_key import BlockKey
from kvstore.block_store import TieredBlockStore
from kvstore.redis_index import RedisBlockIndex

LOCAL = ""


@dataclass(frozen=True)
class BlockSource:
    node: str   # LOCAL, or the store address of the node holding the block
    tier: str


def find_prefix(store: TieredBlockStore, index: RedisBlockIndex | None, keys: Sequence[BlockKey],
                include_remote: bool) -> list[BlockSource]:
    """Where each block of the longest loadable prefix lives, from the first block on."""
    num_local = store.longest_prefix(keys)
    sources = [BlockSource(LOCAL, store.tier_of(key.block_hash) or "") for key in keys[:num_local]]
    if not include_remote or index is None or num_local == len(keys):
        return sources
    for entry in index.probe([key.block_hash for key in keys[num_local:]]):
        if entry is None or entry.node == index.node:  # unknown, or a stale entry of ours: a miss
            break
        sources.append(BlockSource(entry.node, entry.tier))
    return sources

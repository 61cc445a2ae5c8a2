"""Which prompt prefixes each worker has lately computed or received, as this gateway routed them:
its estimate of what the worker's engine prefix cache holds, so conditional disaggregation weighs
a prompt by its effective length (prompt minus the cached prefix), like Dynamo's router and
SGLang's cache-aware router (an approximate tree per worker, fed by routing decisions, not by the
engines).

Per worker, an LRU of chained block hashes (block i's hash covers tokens 0 .. i·B + B), at most
`capacity_tokens` worth; the oldest blocks go first, as an engine's free-block queue evicts them.
The granularity `block_tokens` need not be the engines' block size: the estimate is off by less
than a block. Being an estimate, it can be wrong both ways (an engine evicted sooner than the
LRU did; another gateway filled the cache): a wrong guess costs time, never correctness.

Blocks are named as everywhere in the mesh (pdmesh/kv/block_hash.py), salted with the request's
cache salt as the engines' are: a prefix one tenant sent is not seen for another, whose engine
cache would not hold it either. Unsalted, the decision it feeds (`transfer.local_prefill` in the
answer) told any client whether some other tenant had lately sent the prompt.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from pdmesh.kv.block_hash import chain_block_hashes, salt_extra_key


def prefix_hashes(token_ids: Sequence[int], block_tokens: int, cache_salt: str = "") -> list[bytes]:
    """Chained names of the prompt's full blocks of `block_tokens`, salted as the engines' are (one
    block name function for the whole mesh: pdmesh/kv/block_hash.py)."""
    return chain_block_hashes(b"", token_ids, block_tokens, salt_extra_key(cache_salt))


class SeenPrefixes:
    def __init__(self, block_tokens: int = 32, capacity_tokens: int = 1 << 18) -> None:
        self.block_tokens = block_tokens
        self._capacity_blocks = max(1, capacity_tokens // block_tokens)
        self._blocks: dict[str, OrderedDict[bytes, None]] = {}

    def cached_tokens(self, address: str, hashes: Sequence[bytes], num_prompt_tokens: int) -> int:
        """Leading prompt tokens `address` likely holds (never the last one: an engine computes it)."""
        seen = self._blocks.get(address)
        num_blocks = 0
        if seen:
            for block_hash in hashes:
                if block_hash not in seen:
                    break
                num_blocks += 1
        return min(num_blocks * self.block_tokens, max(0, num_prompt_tokens - 1))

    def record(self, address: str, hashes: Sequence[bytes]) -> None:
        seen = self._blocks.setdefault(address, OrderedDict())
        for block_hash in hashes:
            seen[block_hash] = None
            seen.move_to_end(block_hash)
        while len(seen) > self._capacity_blocks:
            seen.popitem(last=False)

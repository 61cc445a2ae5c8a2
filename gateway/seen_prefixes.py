"""Which prompt prefixes each worker has lately computed or received, as this gateway routed them:
its estimate of what the worker's engine prefix cache holds, so conditional disaggregation weighs
a prompt by its effective length (prompt minus the cached prefix), like Dynamo's router and
SGLang's cache-aware router (an approximate tree per worker, fed by routing decisions, not by the
engines).

Per worker, an LRU of the blocks' names (gateway/prompt_names.py: the names the engines give them,
at their block size, salted with the request's cache salt as theirs are), at most `capacity_tokens`
worth; the oldest blocks go first, as an engine's free-block queue evicts them. Being an estimate,
it can be wrong both ways (an engine evicted sooner than the LRU did; another gateway filled the
cache): a wrong guess costs time, never correctness. Salted, a prefix one tenant sent is not seen for
another, whose engine cache would not hold it either; unsalted, the decision it feeds
(`transfer.local_prefill` in the answer) told any client whether some other tenant had lately sent
the prompt.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class SeenPrefixes:
    def __init__(self, capacity_tokens: int = 1 << 18) -> None:
        self._capacity_tokens = capacity_tokens
        self._blocks: dict[str, OrderedDict[bytes, None]] = {}

    def cached_tokens(self, address: str, names: Sequence[bytes], block_size: int, num_prompt_tokens: int) -> int:
        """Leading prompt tokens `address` likely holds (never the last one: an engine computes it)."""
        seen = self._blocks.get(address)
        num_blocks = 0
        if seen:
            for name in names:
                if name not in seen:
                    break
                num_blocks += 1
        return min(num_blocks * block_size, max(0, num_prompt_tokens - 1))

    def record(self, address: str, names: Sequence[bytes], block_size: int) -> None:
        seen = self._blocks.setdefault(address, OrderedDict())
        for name in names:
            seen[name] = None
            seen.move_to_end(name)
        while len(seen) > max(1, self._capacity_tokens // block_size):
            seen.popitem(last=False)

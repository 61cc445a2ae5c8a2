"""Which prefill and which decode worker serve a request: round_robin, least_loaded or prefix_aware.

Cost model of prefix_aware (in tokens of prefill compute, the resource a prefill worker sells):
  cost(prefill X) = uncached_tokens(X) + REMOTE_FETCH_COST * remote_tokens(X) + route_load_tokens * queue(X)
- uncached_tokens: prompt tokens past the longest prefix the KV store index knows of; X computes them.
- remote_tokens: tokens of that prefix held by other nodes: X fetches them from their stores, which
  costs about a fifth of computing them (bench_kvstore: a 2,048-token prompt cached in DRAM reached
  its first token in 0.19x the cold time).
- queue(X): requests on X now (this gateway's in flight, or what X last reported to the registry, if
  more); each delays a new one by about one prefill, `route_load_tokens` tokens' worth (config).
So a worker holding the prefix wins until it is busier than recomputing the prefix elsewhere costs.
Ties go to the least loaded, then to round robin order.

Decode workers are chosen by load and free KV: cost(decode Y) = queue(Y) / max_num_seqs(Y) +
kv_cache_usage(Y), both fractions of Y's capacity (from its registry record); a worker whose free
blocks cannot hold the request is taken only when no other can.
"""

from __future__ import annotations

import itertools
from typing import Protocol

from gateway.pool import Worker
from gateway.prefix_index import PrefixIndex
from gateway.prompt_names import PromptNames

REMOTE_FETCH_COST = 0.2


class RoutePolicy(Protocol):
    name: str

    async def pick_prefill(self, workers: list[Worker], prompt: PromptNames) -> Worker:
        ...

    def pick_decode(self, workers: list[Worker], num_tokens: int) -> Worker:
        ...


class RoundRobin:
    name = "round_robin"

    def __init__(self) -> None:
        self._turns = {"prefill": itertools.count(), "decode": itertools.count()}

    async def pick_prefill(self, workers: list[Worker], prompt: PromptNames) -> Worker:
        return self._next(workers, "prefill")

    def pick_decode(self, workers: list[Worker], num_tokens: int) -> Worker:
        return self._next(workers, "decode")

    def _next(self, workers: list[Worker], role: str) -> Worker:
        ordered = sorted(workers, key=lambda w: w.address)
        return ordered[next(self._turns[role]) % len(ordered)]


def decode_cost(worker: Worker, num_tokens: int) -> tuple[bool, float]:
    """(cannot hold the request, load as a fraction of capacity); lower sorts first."""
    record = worker.record
    if record is None:
        return False, float(worker.queue())
    free_blocks = record.num_kv_blocks * (1.0 - record.kv_cache_usage)
    block_size = worker.info.compat.block_size if worker.info else 1
    too_small = record.num_kv_blocks > 0 and free_blocks * block_size < num_tokens
    return too_small, worker.queue() / max(1, record.max_num_seqs) + record.kv_cache_usage


class LeastLoaded(RoundRobin):
    name = "least_loaded"

    async def pick_prefill(self, workers: list[Worker], prompt: PromptNames) -> Worker:
        return self._cheapest(workers, "prefill", lambda w: w.queue())

    def pick_decode(self, workers: list[Worker], num_tokens: int) -> Worker:
        return self._cheapest(workers, "decode", lambda w: decode_cost(w, num_tokens))

    def _cheapest(self, workers: list[Worker], role: str, cost) -> Worker:
        """Lowest cost; among equals, round robin (so idle workers share the work)."""
        costs = [cost(w) for w in workers]
        lowest = min(costs)
        return self._next([w for w, c in zip(workers, costs) if c == lowest], role)


class PrefixAware(LeastLoaded):
    name = "prefix_aware"

    def __init__(self, index: PrefixIndex | None, load_tokens: int) -> None:
        super().__init__()
        self._index = index
        self._load_tokens = load_tokens

    async def pick_prefill(self, workers: list[Worker], prompt: PromptNames) -> Worker:
        holders = await self._holders(workers[0], prompt)
        return self._cheapest(workers, "prefill", lambda w: self.prefill_cost(w, len(prompt), holders))

    def prefill_cost(self, worker: Worker, num_tokens: int, holders: list[str]) -> float:
        block_size = worker.info.compat.block_size
        local_tokens = sum(1 for node in holders if node == worker.info.kv_address) * block_size
        remote_tokens = len(holders) * block_size - local_tokens
        uncached_tokens = num_tokens - len(holders) * block_size
        return uncached_tokens + REMOTE_FETCH_COST * remote_tokens + self._load_tokens * worker.queue()

    async def _holders(self, worker: Worker, prompt: PromptNames) -> list[str]:
        if self._index is None:
            return []
        return await self._index.holders(worker.info.compat, prompt)


def make_policy(name: str, index: PrefixIndex | None, load_tokens: int) -> RoutePolicy:
    if name == "round_robin":
        return RoundRobin()
    if name == "least_loaded":
        return LeastLoaded()
    return PrefixAware(index, load_tokens)

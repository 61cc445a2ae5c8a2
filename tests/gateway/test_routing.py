"""Routing policies and their cost model (fake workers as plain objects), and the gateway's view of
the KV store index on a real Redis."""

import pytest

from gateway.pool import Worker
from gateway.prefix_index import PrefixIndex
from gateway.prompt_names import PromptNames
from gateway.routing import LeastLoaded, PrefixAware, RoundRobin, decode_cost
from kvstore.block_key import block_keys
from kvstore.redis_index import RedisBlockIndex
from kvstore.store_events import BlockPlaced
from pdmesh.compat import fingerprint_seed
from pdmesh.registry import WorkerRecord
from tests.gateway.fake_workers import COMPAT, info

PROMPT = list(range(3, 3 + 200))   # 6 full blocks of 32 + 8 tokens


def _worker(address: str, role: str = "prefill", in_flight: int = 0, record: WorkerRecord | None = None) -> Worker:
    worker_info = info(role)
    worker_info.kv_address = f"kv-{address}" if role == "prefill" else ""
    return Worker(address, role, channel=None, info=worker_info, in_flight=in_flight, record=record)


class FakeIndex:
    def __init__(self, holders: list[str]) -> None:
        self._holders = holders
        self.salts: list[str] = []

    async def holders(self, compat, prompt: PromptNames) -> list[str]:
        self.salts.append(prompt.cache_salt)
        return self._holders


async def test_prefix_aware_picks_the_worker_holding_the_prefix():
    a, b = _worker("a"), _worker("b")
    index = FakeIndex(["kv-b"] * 6)
    policy = PrefixAware(index, load_tokens=256)
    assert await policy.pick_prefill([a, b], PromptNames(PROMPT, "salt")) is b
    assert index.salts == ["salt"]
    # cost: a fetches 192 tokens remotely (0.2 each) and computes 8; b computes 8
    assert (policy.prefill_cost(a, 200, index._holders), policy.prefill_cost(b, 200, index._holders)) == (
        pytest.approx(8 + 0.2 * 192), 8)


async def test_prefix_aware_leaves_a_holder_that_is_busier_than_recomputing():
    a, b = _worker("a"), _worker("b", in_flight=1)
    policy = PrefixAware(FakeIndex(["kv-b"] * 6), load_tokens=256)
    assert await policy.pick_prefill([a, b], PromptNames(PROMPT, "")) is a   # 46.4 < 8 + 256


async def test_without_a_cached_prefix_the_least_loaded_wins_then_round_robin():
    a, b = _worker("a", in_flight=2), _worker("b", in_flight=1)
    policy = PrefixAware(FakeIndex([]), load_tokens=256)
    assert await policy.pick_prefill([a, b], PromptNames(PROMPT, "")) is b
    b.in_flight = 2
    picks = [await policy.pick_prefill([a, b], PromptNames(PROMPT, "")) for _ in range(4)]
    assert [w.address for w in picks] == ["b", "a", "b", "a"]   # the turn counter moved on the first pick


def _record(address: str, running: int = 0, usage: float = 0.0, num_kv_blocks: int = 1000) -> WorkerRecord:
    return WorkerRecord(role="decode", address=address, kv_address="", model="tiny-llama", model_fingerprint="fp",
                        max_num_seqs=64, num_kv_blocks=num_kv_blocks, num_running=running, kv_cache_usage=usage)


def test_decode_cost_weighs_queue_against_capacity_and_kv_usage():
    busy = _worker("d1", "decode", record=_record("d1", running=32, usage=0.1))
    full = _worker("d2", "decode", record=_record("d2", usage=0.9))
    assert decode_cost(busy, 100) == (False, pytest.approx(0.6))
    assert decode_cost(full, 100) == (False, pytest.approx(0.9))
    assert LeastLoaded().pick_decode([full, busy], 100) is busy
    # 100 free blocks of 32 tokens hold 3,200 tokens, not 4,000: the full one is a last resort
    assert decode_cost(full, 4000) == (True, pytest.approx(0.9))
    assert LeastLoaded().pick_decode([full, _worker("d3", "decode", record=_record("d3", running=64))], 4000) \
        .address == "d3"


def test_round_robin_cycles_in_address_order():
    workers = [_worker("b"), _worker("a"), _worker("c")]
    policy = RoundRobin()
    assert [policy.pick_decode(workers, 1).address for _ in range(4)] == ["a", "b", "c", "a"]


async def test_prefix_index_reads_the_stores_entries_from_redis(redis_server):
    keys = block_keys(fingerprint_seed(COMPAT), PROMPT, 32, b"tenant-salt")
    store_index = RedisBlockIndex.connect(redis_server.url, redis_server.password, COMPAT.model_fingerprint,
                                          node="kv-b", ttl_s=60)
    store_index.on_events([BlockPlaced(k.block_hash, "dram", 1024, 0) for k in keys[:4]])
    store_index.close()
    index = PrefixIndex(redis_server.url, redis_server.password)
    try:
        assert await index.holders(COMPAT, PromptNames(PROMPT, "tenant-salt")) == ["kv-b"] * 4
        assert await index.holders(COMPAT, PromptNames(PROMPT, "other-tenant")) == []
        assert await index.holders(COMPAT, PromptNames(PROMPT[:31], "tenant-salt")) == []
    finally:
        index.close()

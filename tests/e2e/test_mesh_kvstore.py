"""The tiered KV store in a real cluster: two prefill workers (engine prefix cache off, so every
reuse comes from the store) with NVMe folders and a shared real Redis index, one decode worker.

Each scenario sends two prompts sharing a 512-token prefix: the second computes only what the
store lacks, from whichever tier or node holds it, and both equal monolithic vLLM token for token.
"""

from __future__ import annotations

import asyncio
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvstore.block_key import block_keys
from kvstore.disk_tier import find_block
from pdmesh.cluster import LocalCluster
from pdmesh.telemetry.tracing import CLIENT_REQUEST_ID_KEY
from pdmesh.compat import fingerprint_seed
from pdmesh.v1 import worker_pb2, worker_pb2_grpc
from tests.kvstore.factories import flip_bit
from tests.e2e.conftest import (HOLD_TIMEOUT_S, STORE_PREFIX_TOKENS, STORE_SUFFIX_TOKENS, mesh_channel,
                                settled_stats, store_prompt_pair, telemetry_flags, worker_stats)
from tests.e2e.store_scenarios import BLOCK_SIZE, PROMPT_TOKENS, first_then_second, spill

pytestmark = pytest.mark.vllm
BLOCK_NBYTES = 4 * 2 * 32 * 128 * 4  # layers * (K,V) * block_size * (kv_heads * head_dim) * fp32


@pytest.fixture(scope="module")
def store_cluster(tiny_llama_dir, reference, redis, otlp_receiver, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("store-cluster")
    worker_args = ["--hold_timeout_s", str(HOLD_TIMEOUT_S), "--no-engine.enable_prefix_caching",
                   "--store.redis_url", redis.url, "--store.redis_password", redis.password,
                   "--store.load_budget_min_s", "60"]  # never cut: the tests count which tokens the store served
    with LocalCluster(tiny_llama_dir, run_dir, num_prefill=2, worker_args=worker_args, store_dir=run_dir / "nvme",
                      telemetry_args=telemetry_flags(otlp_receiver.endpoint)) as running:
        yield running
        for address in running.prefill_addresses:  # leak check: nothing pinned, nothing being read
            stats = asyncio.run(settled_stats(address))
            assert (stats.num_held_transfers, stats.num_expired_transfers, stats.kv_store_pinned_blocks) == (0, 0, 0)


@pytest.mark.parametrize("scenario, spill_to", [("device", None), ("dram", "dram"), ("nvme", "nvme")])
async def test_a_shared_prefix_is_loaded_from_each_tier_and_only_the_rest_is_computed(
        store_cluster, tiny_llama_dir, reference, scenario, spill_to):
    async def spill_prefix():
        assert await spill(store_cluster, 0, spill_to) >= STORE_PREFIX_TOKENS // BLOCK_SIZE

    transfer = await first_then_second(store_cluster, tiny_llama_dir, reference, scenario, 0, 0,
                                       between=spill_prefix if spill_to else None)
    assert dict(transfer.prefill_store_tokens) == {scenario: STORE_PREFIX_TOKENS}
    assert (transfer.prefill_computed_tokens, transfer.prefill_cached_tokens) == (
        STORE_SUFFIX_TOKENS, STORE_PREFIX_TOKENS)


async def test_a_prefix_another_worker_computed_is_fetched_from_its_store(store_cluster, tiny_llama_dir, reference,
                                                                       otlp_receiver):
    before = await worker_stats(store_cluster.prefill_addresses[1])
    transfer = await first_then_second(store_cluster, tiny_llama_dir, reference, "remote", 0, 1)
    assert dict(transfer.prefill_store_tokens) == {"remote": STORE_PREFIX_TOKENS}
    assert transfer.prefill_computed_tokens == STORE_SUFFIX_TOKENS
    after = await worker_stats(store_cluster.prefill_addresses[1])
    num_blocks = STORE_PREFIX_TOKENS // BLOCK_SIZE
    assert after.kv_store_hit_blocks["remote"] - before.kv_store_hit_blocks["remote"] == num_blocks
    _assert_store_spans(otlp_receiver, "remote-second", num_blocks)


def _assert_store_spans(otlp_receiver, request_id: str, num_blocks: int) -> None:
    """The load, the export it asked of the other node (read over shared memory: one host) and the
    save all sit in the request's trace."""
    wanted = {"prefill", "kvstore.load", "kvstore.export", "kvstore.save"}

    def prefill_trace(spans):
        """The spans in the trace of the request's prefill (the test's own gateway exports none)."""
        trace_ids = {s.trace_id for s in spans if s.name == "prefill" and s.attributes.get(CLIENT_REQUEST_ID_KEY) ==
                     request_id}
        return [s for s in spans if s.trace_id in trace_ids]

    spans = prefill_trace(otlp_receiver.wait_for(lambda all_: wanted <= {s.name for s in prefill_trace(all_)}))
    by_name = {s.name: s for s in spans}
    by_id = {s.span_id: s for s in spans}
    assert len({s.trace_id for s in spans}) == 1
    assert {s.attributes.get(CLIENT_REQUEST_ID_KEY) for s in spans} == {request_id}

    def parent_name(name: str) -> str:
        return by_id[by_name[name].parent_span_id].name

    assert parent_name("kvstore.load") == parent_name("kvstore.save") == "prefill"
    assert parent_name("kvstore.export") == "/pdmesh.v1.KVStore/Export"
    assert by_name["kvstore.export"].service == "pdmesh-prefill-engine"
    load = by_name["kvstore.load"].attributes
    assert (load["pdmesh.kvstore.tokens.remote"], load["pdmesh.kvstore.blocks"], load["pdmesh.kv.bytes"],
            load["pdmesh.kv.transport"]) == (num_blocks * BLOCK_SIZE, num_blocks, num_blocks * BLOCK_NBYTES, "shm")
    assert by_name["kvstore.export"].attributes["pdmesh.kv.bytes"] == num_blocks * BLOCK_NBYTES
    # the second prompt's new full block (its suffix) is the only one this node lacked
    assert by_name["kvstore.save"].attributes["pdmesh.kvstore.blocks_saved"] == num_blocks + 1


@pytest.mark.parametrize("scenario", ["redis_flushed", "redis_restarted"])
async def test_redis_losing_the_index_is_a_miss_and_the_output_stays_right(
        store_cluster, tiny_llama_dir, reference, redis, scenario):
    async def lose_index():
        if scenario == "redis_flushed":
            redis.client().flushall()
        else:
            await asyncio.to_thread(redis.restart)

    transfer = await first_then_second(store_cluster, tiny_llama_dir, reference, scenario, 0, 1,
                                       between=lose_index)
    assert (dict(transfer.prefill_store_tokens), transfer.prefill_computed_tokens) == ({}, PROMPT_TOKENS)


async def test_a_bit_flipped_on_nvme_is_detected_counted_and_recomputed(store_cluster, tiny_llama_dir, reference):
    corrupt_block = 5
    address = store_cluster.prefill_addresses[0]
    before = await worker_stats(address)

    async def flip_a_bit():
        await spill(store_cluster, 0, "nvme")
        async with mesh_channel(address) as channel:
            info = await worker_pb2_grpc.WorkerInfoStub(channel).GetInfo(worker_pb2.GetInfoRequest())
        keys = block_keys(fingerprint_seed(info.compat), store_prompt_pair("corrupt_nvme")[0], BLOCK_SIZE)
        path, offset = find_block(store_cluster.store_dir / "prefill-0", keys[corrupt_block].block_hash,
                                  info.compat.block_nbytes)
        flip_bit(path, offset + 1000, 0x04)

    transfer = await first_then_second(store_cluster, tiny_llama_dir, reference, "corrupt_nvme", 0, 0,
                                       between=flip_a_bit)
    assert dict(transfer.prefill_store_tokens) == {"nvme": corrupt_block * BLOCK_SIZE}
    assert transfer.prefill_computed_tokens == PROMPT_TOKENS - corrupt_block * BLOCK_SIZE
    after = await worker_stats(address)
    assert after.kv_store_corrupt_blocks - before.kv_store_corrupt_blocks == 1
    metrics = urllib.request.urlopen(f"http://{store_cluster.metrics_addresses['prefill-0']}/metrics").read().decode()
    corrupt = {s.name: s.value for f in text_string_to_metric_families(metrics) for s in f.samples}
    assert corrupt["pdmesh_kv_store_corrupt_blocks_total"] == after.kv_store_corrupt_blocks

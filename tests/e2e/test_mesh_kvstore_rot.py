"""Blocks rotting at rest in the KV store's memory tiers (the NVMe tier's bit flip is in
test_mesh_kvstore.py): a prefill worker whose device and DRAM tiers keep every block with one bit
flipped (kv_faults.rot_store_tiers, after the store took the checksums). A prompt sharing a stored
prefix finds it in the store, the load catches every rotten block by its checksum, drops it,
counts it under the tier that held it, and the prompt is computed: nothing is served from the
store and the output equals monolithic vLLM token for token. A store that did not verify would
serve the rotten prefix (the store-token assertions fail)."""

from __future__ import annotations

import asyncio

import pytest

from pdmesh.cluster import LocalCluster
from tests.e2e.conftest import HOLD_TIMEOUT_S, STORE_PREFIX_TOKENS, settled_stats, worker_stats
from tests.e2e.store_scenarios import BLOCK_SIZE, PROMPT_TOKENS, first_then_second, spill

pytestmark = pytest.mark.vllm
NUM_PREFIX_BLOCKS = STORE_PREFIX_TOKENS // BLOCK_SIZE


@pytest.fixture(scope="module")
def rotting_cluster(tiny_llama_dir, reference, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("rotting-store")
    worker_args = ["--hold_timeout_s", str(HOLD_TIMEOUT_S), "--no-engine.enable_prefix_caching",
                   "--store.load_budget_min_s", "60"]
    with LocalCluster(tiny_llama_dir, run_dir, num_prefill=1, worker_args=worker_args, store_dir=run_dir / "nvme",
                      prefill_args=["--kv_faults.rot_store_tiers", "device,dram"]) as running:
        yield running
        stats = asyncio.run(settled_stats(running.prefill_addresses[0]))   # leak check: nothing pinned
        assert (stats.num_held_transfers, stats.num_expired_transfers, stats.kv_store_pinned_blocks) == (0, 0, 0)


@pytest.mark.parametrize("tier", ["device", "dram"])
async def test_a_prefix_rotting_in_a_memory_tier_is_caught_dropped_and_computed(rotting_cluster, tiny_llama_dir,
                                                                                  reference, tier):
    address = rotting_cluster.prefill_addresses[0]
    before = await worker_stats(address)

    async def demote_prefix():
        assert await spill(rotting_cluster, 0, tier) >= NUM_PREFIX_BLOCKS

    transfer = await first_then_second(rotting_cluster, tiny_llama_dir, reference, tier, 0, 0,
                                       between=demote_prefix if tier != "device" else None)
    assert (dict(transfer.prefill_store_tokens), transfer.prefill_computed_tokens) == ({}, PROMPT_TOKENS)
    after = await worker_stats(address)
    caught = {name: after.kv_store_corrupt_blocks_by_tier[name] - before.kv_store_corrupt_blocks_by_tier[name]
              for name in after.kv_store_corrupt_blocks_by_tier}
    assert {name: n for name, n in caught.items() if n} == {tier: NUM_PREFIX_BLOCKS}
    assert after.kv_store_corrupt_blocks - before.kv_store_corrupt_blocks == NUM_PREFIX_BLOCKS

"""Workers taking both roles (python -m node): each computes a prompt and holds its KV for the other,
decodes from the other's KV, or serves a request whole, per request, with greedy tokens equal to
monolithic vLLM's either way."""

from __future__ import annotations

import asyncio

import pytest

from pdmesh.client import generate, make_request
from pdmesh.cluster import LocalCluster
from tests.e2e.conftest import HOLD_TIMEOUT_S, MAX_TOKENS, in_process_gateway, settled_stats, token_prompts, \
    worker_stats
from tests.e2e.greedy import assert_greedy_tokens_equal

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def nodes(tiny_llama_dir, reference, tmp_path_factory):
    with LocalCluster(tiny_llama_dir, tmp_path_factory.mktemp("nodes"), num_prefill=0, num_decode=0, num_both=2,
                      worker_args=["--hold_timeout_s", str(HOLD_TIMEOUT_S)]) as running:
        yield running
        for address in running.both_addresses:   # leak check: every transfer either held was released
            stats = asyncio.run(settled_stats(address))
            assert (stats.num_held_transfers, stats.num_expired_transfers) == (0, 0), address


@pytest.mark.parametrize("policy", ["remote", "local", "conditional", "adaptive"])
async def test_greedy_tokens_equal_monolithic_whichever_role_each_worker_takes(nodes, reference, tiny_llama_dir,
                                                                                policy):
    async with in_process_gateway(nodes, tiny_llama_dir, prefill_workers=[], decode_workers=[],
                                  workers=nodes.both_addresses, disagg_policy=policy, with_gateway=True) as (
            gateway, address):
        for index, prompt in enumerate(token_prompts()):
            token_ids, _, last = await generate(address, make_request(prompt, max_tokens=MAX_TOKENS))
            assert_greedy_tokens_equal(token_ids, reference["runs"][0], index)
            if policy == "remote":   # computed on one worker, decoded on the other from its KV
                assert not last.transfer.local_prefill and last.transfer.prefill_worker in nodes.both_addresses
            if policy == "local":
                assert last.transfer.local_prefill and last.transfer.num_blocks == 0
        assert sum(gateway.generator.disagg.decisions.values()) == len(token_prompts())


async def test_each_worker_both_sends_and_receives_kv(nodes):
    """Four requests in the remote flow, the workers taken in turn: each computes prompts for the
    other and decodes from the other's KV."""
    before = [await worker_stats(address) for address in nodes.both_addresses]
    async with in_process_gateway(nodes, nodes.model_dir, prefill_workers=[], decode_workers=[],
                                  workers=nodes.both_addresses, disagg_policy="remote",
                                  route_policy="round_robin") as address:
        for prompt in token_prompts(seed=7)[-4:]:   # 500 to 1,500 tokens: many blocks each
            await generate(address, make_request(prompt, max_tokens=4))
    after = [await worker_stats(address) for address in nodes.both_addresses]
    for old, new in zip(before, after):
        assert new.kv_blocks_sent > old.kv_blocks_sent and new.kv_blocks_received > old.kv_blocks_received

"""Workers taking both roles (python -m node): each computes a prompt and holds its KV for the other,
decodes from the other's KV, or serves a request whole, per request, with greedy tokens equal to
monolithic vLLM's either way."""

from __future__ import annotations

import asyncio

import pytest

from pdmesh.client import generate, make_request, stream_generate
from pdmesh.cluster import LocalCluster
from tests.e2e.conftest import FAILOVER_PROMPT, FAILOVER_SAMPLING, HOLD_TIMEOUT_S, MAX_TOKENS, in_process_gateway, \
    settled_stats, token_prompts, worker_stats
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
        assert 0 < new.decode_step_s < 2.0   # each decoded: its steps are timed and published


LONG_PROMPTS = (15, 16)   # token_prompts()[i]: 1,000 and 1,500 tokens
FULL_BATCH = 8  # streams a worker decodes, as the gateway sees it, when it is "busy"


def adaptive_gateway(nodes, **settings):
    return in_process_gateway(nodes, nodes.model_dir, prefill_workers=[], decode_workers=[],
                              workers=nodes.both_addresses, disagg_policy="adaptive", with_gateway=True, **settings)


def computed_on(last) -> str:
    """The worker that computed the request's prompt."""
    transfer = last.transfer
    return transfer.decode_worker if transfer.local_prefill else transfer.prefill_worker


async def published_rates(gateway, address) -> dict:
    """Sends short requests until every worker has published its prompt rate and decoding step time
    (worker/step_time.py: its second token's step waited for the first's); the workers by address."""
    workers = {w.address: w for w in gateway.pool.workers("decode")}
    for other in workers.values():   # the idle one serves the next: make each the idle one in turn
        for worker in workers.values():
            worker.in_flight += FULL_BATCH * (worker is not other)
        await generate(address, make_request(token_prompts()[3], max_tokens=2))
        for worker in workers.values():
            worker.in_flight -= FULL_BATCH * (worker is not other)
    assert all(w.prefill_tokens_per_s > 0 and 0 < w.decode_step_s < 2.0 for w in workers.values())
    return workers


async def test_short_prompts_on_an_idle_mesh_are_served_whole(nodes, reference):
    async with adaptive_gateway(nodes) as (gateway, address):
        await published_rates(gateway, address)
        for index, prompt in enumerate(token_prompts()[:6]):   # 1 to 33 tokens
            token_ids, _, last = await generate(address, make_request(prompt, max_tokens=MAX_TOKENS))
            assert_greedy_tokens_equal(token_ids, reference["runs"][0], index)
            assert last.transfer.local_prefill and last.transfer.num_blocks == 0


async def test_a_long_prompt_is_computed_off_the_busy_worker_and_a_load_shift_flips_it(nodes, reference):
    """One worker decodes a full batch (as the gateway sees it: its own streams and what others report):
    a long prompt is computed on the other; the load moves over, and so does the prompt's compute."""
    async with adaptive_gateway(nodes) as (gateway, address):
        workers = await published_rates(gateway, address)
        for busy, index in zip(workers.values(), LONG_PROMPTS):   # another prompt: none caches it yet
            busy.in_flight += FULL_BATCH
            try:
                token_ids, _, last = await generate(address, make_request(token_prompts()[index],
                                                                          max_tokens=MAX_TOKENS))
            finally:
                busy.in_flight -= FULL_BATCH
            assert_greedy_tokens_equal(token_ids, reference["runs"][0], index)
            assert computed_on(last) != busy.address and computed_on(last) in workers


async def test_a_stream_a_prompt_would_stall_moves_to_the_other_worker_every_token_once(nodes, reference):
    """Flowing decodes: a long generation streams on one worker; a long prompt arrives that placement
    computes there (the other looks busier), and its compute would take the stream past the TPOT SLO
    (set tiny here): the stream moves to the other worker mid-flight, resumed from the tokens sent.
    Every token arrives once, equal to monolithic vLLM's."""
    async with adaptive_gateway(nodes, tpot_slo_s=1e-6) as (gateway, address):
        workers = await published_rates(gateway, address)
        first, second = workers.values()
        second.in_flight += FULL_BATCH   # the stream goes to `first`, and the long prompt after it
        second.decode_step_s = 0.0       # the batch is pretended: no step time of its own yet (room for the stream)
        try:
            token_ids, last = [], None
            long_prompt = None
            async for response in stream_generate(address, make_request(FAILOVER_PROMPT, **FAILOVER_SAMPLING)):
                token_ids += response.token_ids
                last = response
                if long_prompt is None and len(token_ids) >= 8:
                    long_prompt = asyncio.ensure_future(generate(address, make_request(
                        token_prompts()[LONG_PROMPTS[1]], max_tokens=MAX_TOKENS)))
            long_ids, _, long_last = await long_prompt
        finally:
            second.in_flight -= FULL_BATCH
        assert token_ids == reference["runs"][7]["token_ids"][0]
        assert (last.transfer.num_moves, last.transfer.num_failovers) == (1, 0)
        assert last.transfer.decode_worker == second.address and 8 <= last.transfer.resumed_at_token < 500
        assert computed_on(long_last) == first.address
        assert_greedy_tokens_equal(long_ids, reference["runs"][0], LONG_PROMPTS[1])
        assert gateway.generator.disagg.flows.moves_asked == 1 and not gateway.generator.disagg.flows.streams

"""Greedy (and seeded) output through gateway -> prefill -> decode equals monolithic vLLM, token for token."""

from __future__ import annotations

import asyncio

import pytest

from pdmesh.client import generate, make_request
from tests.e2e.conftest import BLOCK_SIZE, MAX_TOKENS, PROMPT_LENGTHS, SEEDED, TEXT_PROMPTS, in_process_gateway, \
    token_prompts, worker_stats
from tests.e2e.greedy import assert_greedy_tokens_equal

pytestmark = pytest.mark.vllm
BLOCK_NBYTES = 4 * 2 * 32 * 128 * 4  # layers * (K,V) * block_size * (kv_heads * head_dim) * fp32


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


async def test_greedy_tokens_equal_monolithic_for_every_prompt_length(cluster, reference):
    for index, (prompt, length) in enumerate(zip(token_prompts(), PROMPT_LENGTHS)):
        token_ids, _, last = await generate(cluster.gateway_address, make_request(prompt, max_tokens=MAX_TOKENS))
        assert_greedy_tokens_equal(token_ids, reference["runs"][0], index)
        assert last.usage.prompt_tokens == length
        assert last.usage.completion_tokens == len(token_ids)


async def test_concurrent_requests_equal_monolithic(cluster, reference):
    results = await asyncio.gather(*(generate(cluster.gateway_address, make_request(p, max_tokens=MAX_TOKENS))
                                     for p in token_prompts()))
    for index, (token_ids, _, _) in enumerate(results):
        assert_greedy_tokens_equal(token_ids, reference["runs"][0], index)


async def test_text_prompts_are_tokenized_as_vllm_does_and_decode_equal(cluster, reference):
    run = reference["runs"][1]
    for text, want_ids, want_prompt in zip(TEXT_PROMPTS, run["token_ids"], run["prompt_token_ids"]):
        token_ids, _, last = await generate(cluster.gateway_address, make_request(text, max_tokens=MAX_TOKENS))
        assert (token_ids, last.usage.prompt_tokens) == (want_ids, len(want_prompt))


async def test_seeded_sampling_equals_monolithic(cluster, reference):
    sampling = {k: v for k, v in SEEDED.items() if k != "max_tokens"}
    for prompt, want in zip(token_prompts()[:4], reference["runs"][2]["token_ids"]):
        token_ids, _, _ = await generate(cluster.gateway_address,
                                         make_request(prompt, max_tokens=SEEDED["max_tokens"], **sampling))
        assert token_ids == want


def _fresh_prompt(length: int, salt: int) -> list[int]:
    """A prompt no other test sent, so neither worker has any of it in its prefix cache."""
    return [0] + [(salt * 7919 + i * 104729) % 1021 + 3 for i in range(length - 1)]


async def test_decode_received_the_prompt_kv_and_did_not_recompute_it(cluster):
    decode_before = await worker_stats(cluster.decode_addresses[0])
    prefill_before = await worker_stats(cluster.prefill_addresses[0])
    num_bytes = 0
    for prompt in [_fresh_prompt(n, salt) for salt, n in enumerate([64, 65, 100, 128])]:
        _, _, last = await generate(cluster.gateway_address, make_request(prompt, max_tokens=4))
        num_blocks = _cdiv(len(prompt), BLOCK_SIZE)
        assert (last.transfer.num_blocks, last.transfer.num_bytes) == (num_blocks, num_blocks * BLOCK_NBYTES)
        assert last.transfer.num_cached_tokens == len(prompt)  # decode computed only the last prompt token
        assert last.transfer.seconds > 0
        num_bytes += last.transfer.num_bytes
    decode_after = await worker_stats(cluster.decode_addresses[0])
    prefill_after = await worker_stats(cluster.prefill_addresses[0])
    assert decode_after.kv_bytes_received - decode_before.kv_bytes_received == num_bytes
    assert prefill_after.kv_bytes_sent - prefill_before.kv_bytes_sent == num_bytes
    assert decode_after.kv_failed_blocks == decode_before.kv_failed_blocks
    assert prefill_after.num_held_transfers == 0


async def test_repeated_prompt_pulls_only_what_decode_does_not_cache(cluster, reference):
    prompt = _fresh_prompt(100, salt=99)
    _, _, first = await generate(cluster.gateway_address, make_request(prompt, max_tokens=4))
    second_ids, _, second = await generate(cluster.gateway_address, make_request(prompt, max_tokens=4))
    assert first.transfer.num_blocks == 4
    assert second.transfer.num_blocks == 1  # 3 full blocks hit decode's own prefix cache; the tail moves
    assert second.transfer.num_cached_tokens == 100


async def test_first_token_from_prefill_gives_the_same_greedy_tokens(cluster, reference, tiny_llama_dir):
    """SGLang's flow: prefill's own token streams first, decode continues from prompt + token."""
    async with in_process_gateway(cluster, tiny_llama_dir, first_token_from="prefill") as address:
        for index, prompt in enumerate(token_prompts()):
            token_ids, _, last = await generate(address, make_request(prompt, max_tokens=MAX_TOKENS))
            assert_greedy_tokens_equal(token_ids, reference["runs"][0], index)
            assert last.usage.completion_tokens == len(token_ids)


@pytest.mark.parametrize("policy", ["local", "conditional"])
async def test_local_and_conditional_prefill_give_the_same_greedy_tokens(cluster, reference, tiny_llama_dir, policy):
    """Conditional disaggregation: decode computing the prompt itself changes no token."""
    async with in_process_gateway(cluster, tiny_llama_dir, with_gateway=True, disagg_policy=policy) as (gateway,
                                                                                                        address):
        num_local = 0
        for index, prompt in enumerate(token_prompts()):
            token_ids, _, last = await generate(address, make_request(prompt, max_tokens=MAX_TOKENS))
            assert_greedy_tokens_equal(token_ids, reference["runs"][0], index)
            num_local += last.transfer.local_prefill
            if last.transfer.local_prefill:
                assert (last.transfer.num_blocks, last.transfer.prefill_worker) == (0, "")
        decisions = gateway.generator.disagg.decisions
        assert sum(n for (local, _), n in decisions.items() if local) == num_local
    if policy == "local":
        assert num_local == len(token_prompts())
    assert (await worker_stats(cluster.prefill_addresses[0])).num_held_transfers == 0

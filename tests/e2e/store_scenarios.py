"""The KV-store scenarios' requests (tests/e2e/test_mesh_kvstore*.py): each scenario sends two
prompts sharing a 512-token prefix (conftest.store_prompt_pair), the first computed and saved, the
second reading what the store holds; both must equal monolithic vLLM token for token."""

from __future__ import annotations

import asyncio


from pdmesh.client import generate, make_request
from pdmesh.v1 import worker_pb2, worker_pb2_grpc
from tests.e2e.conftest import (STORE_PREFIX_TOKENS, STORE_SCENARIOS, STORE_SUFFIX_TOKENS, in_process_gateway,
                                mesh_channel, store_prompt_pair, worker_stats)

BLOCK_SIZE = 32
PROMPT_TOKENS = STORE_PREFIX_TOKENS + STORE_SUFFIX_TOKENS
MAX_TOKENS = 16


def expected_outputs(reference, scenario: str) -> list[list[int]]:
    outputs = reference["runs"][4]["token_ids"]
    i = STORE_SCENARIOS.index(scenario)
    return [token_ids[:MAX_TOKENS] for token_ids in outputs[2 * i:2 * i + 2]]


async def generate_on(cluster, tokenizer_dir, prefill: int, prompt: list[int], request_id: str):
    """Tokens and final response of a request whose prefill runs on one chosen worker."""
    async with in_process_gateway(cluster, tokenizer_dir, prefill_workers=[cluster.prefill_addresses[prefill]]) \
            as address:
        token_ids, _, last = await generate(address, make_request(prompt, max_tokens=MAX_TOKENS,
                                                                  request_id=request_id))
    return token_ids, last


async def spill(cluster, prefill: int, tier: str) -> int:
    async with mesh_channel(cluster.prefill_addresses[prefill]) as channel:
        response = await worker_pb2_grpc.WorkerInfoStub(channel).SpillKV(worker_pb2.SpillKVRequest(tier=tier))
    return response.num_blocks_moved


async def first_then_second(cluster, tokenizer_dir, reference, scenario: str, first_on: int, second_on: int,
                             between=None):
    """Sends a scenario's two prompts; asserts both equal monolithic vLLM; returns the second's stats."""
    first_prompt, second_prompt = store_prompt_pair(scenario)
    want_first, want_second = expected_outputs(reference, scenario)
    token_ids, first = await generate_on(cluster, tokenizer_dir, first_on, first_prompt, f"{scenario}-first")
    assert token_ids == want_first
    assert (first.transfer.prefill_computed_tokens, dict(first.transfer.prefill_store_tokens)) == (PROMPT_TOKENS, {})
    await saved(cluster, first_on)
    if between is not None:
        await between()
    token_ids, second = await generate_on(cluster, tokenizer_dir, second_on, second_prompt, f"{scenario}-second")
    assert token_ids == want_second
    return second.transfer


async def saved(cluster, prefill: int, timeout_s: float = 10.0) -> None:
    """Saves run in the background (the blocks are unpinned once copied out, before the store and its
    Redis index have them): wait until nothing is pinned and no save is queued or being written."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        stats = await worker_stats(cluster.prefill_addresses[prefill])
        if (stats.num_held_transfers, stats.kv_store_saves_pending) == (0, 0):
            return
        assert asyncio.get_running_loop().time() < deadline, "save did not finish"
        await asyncio.sleep(0.05)

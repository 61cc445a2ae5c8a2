"""A prefill worker with tensor parallelism 2 and a decode worker with 1, real vLLM engines.

vLLM's CPU backend keeps a layer's blocks as [num_blocks, num_kv_heads, block_size, 2 * head_size]:
each prefill rank holds one of tiny-llama's two KV heads and serves it on its own KV port (kv_port
+ rank); decode reads both ranks' transfers (shared memory, one host) and lands rank j's head as its
head j. Greedy output equals monolithic vLLM token for token; the same KV altered unchecked changes
the output (the control); both ranks' pins are released.

It needs a core per engine process: on two cores the second rank shares a core with the spinning
decode engine while the first spins in vLLM's CPU all-reduce waiting for it, and torch's compiler,
which vLLM's CPU ops invoke on new shapes, then ran for minutes in that rank (py-spy: dynamo
tracing under RMSNorm; seen 30 s, 60 s and > 5 min stalls). So below 4 cores it runs only when asked:
PDMESH_TP_E2E=1 bash scripts/test.sh tests/e2e/test_mesh_tensor_parallel.py. The timeouts are
generous so a stall is waited out rather than turned into recompute and expiry.
"""

from __future__ import annotations

import asyncio
import os

import pytest

from pdmesh.client import generate, make_request
from pdmesh.cluster import LocalCluster
from tests.e2e.conftest import KV_TRANSPORTS, MAX_TOKENS, PROMPT_LENGTHS, assert_nothing_pinned, tamper_prompts, \
    token_prompts, worker_stats

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(
    (os.cpu_count() or 1) < 4 and not os.environ.get("PDMESH_TP_E2E"),
    reason="two prefill ranks and a decode engine need a core each (see the module docstring)")]
BLOCK_NBYTES = 4 * 2 * 32 * 128 * 4  # decode's block: 4 layers, both KV heads
TP_ARGS = ["--engine.tensor_parallel_size", "2", "--engine.omp_threads_bind", "0|1"]  # one core a rank
WORKER_ARGS = ["--kv_faults.tamper_request_prefix", "tamper-",
               "--kv_faults.unverified_request_prefix", "tamper-unverified-",
               "--pull_timeout_s", "150", "--hold_timeout_s", "300"]
LENGTHS = [1, 17, 32, 33, 65, 129, 500]  # a token, a partial block, full blocks, blocks and a remainder


@pytest.fixture(scope="module")
def tp_mesh(tiny_llama_dir, reference, tmp_path_factory):
    with LocalCluster(tiny_llama_dir, tmp_path_factory.mktemp("cluster-tp"), worker_args=WORKER_ARGS,
                      prefill_args=TP_ARGS) as running:
        yield running
        assert_nothing_pinned(running)


async def test_greedy_tokens_equal_monolithic_with_two_prefill_ranks_and_one_decode(tp_mesh, reference):
    picked = [PROMPT_LENGTHS.index(length) for length in LENGTHS]
    expected = [reference["runs"][0]["token_ids"][i] for i in picked]
    results = await asyncio.gather(*(generate(tp_mesh.gateway_address, make_request(token_prompts()[i],
                                                                                    max_tokens=MAX_TOKENS))
                                     for i in picked))
    for (token_ids, _, last), want, length in zip(results, expected, LENGTHS):
        assert token_ids == want, f"prompt of {length} tokens diverged"
        num_full_or_partial = -(-length // 32)
        assert (last.transfer.num_blocks, last.transfer.num_bytes) == (num_full_or_partial,
                                                                        num_full_or_partial * BLOCK_NBYTES)
    stats = await worker_stats(tp_mesh.decode_addresses[0])
    assert stats.kv_failed_blocks == 0


async def test_kv_altered_between_the_ranks_and_decode_changes_the_output_unchecked(tp_mesh, reference):
    """Proof the test above can fail: rank shares altered in flight, with the checksum off, give other
    tokens; with it on, they are refused and recomputed, and the tokens are right."""
    index = KV_TRANSPORTS.index("shm")
    wants = reference["runs"][8]["token_ids"][2 * index:2 * index + 2]
    unchecked, checked = tamper_prompts("shm")
    token_ids, _, last = await generate(tp_mesh.gateway_address, make_request(
        checked, max_tokens=MAX_TOKENS, request_id="tamper-tp"))
    assert (token_ids, last.transfer.num_blocks) == (wants[1], 0)
    token_ids, _, last = await generate(tp_mesh.gateway_address, make_request(
        unchecked, max_tokens=MAX_TOKENS, request_id="tamper-unverified-tp"))
    assert last.transfer.num_blocks > 0
    assert token_ids != wants[0], "altered KV left the output unchanged: the control proves nothing"

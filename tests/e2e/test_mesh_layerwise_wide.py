"""The layer-wise flow over Mooncake with the wide test model (512 KiB blocks) and a 2,048-token
prompt (issue 30, item 2). Prefill computes the prompt in one step and announces no layer before
the step is done; decode, made to pause after its first read (the fault settings' stall), finds
the rest written and reads at least 5 layers of 64 blocks (20 MiB and more) at once. That read used
to go to Mooncake as one batch into a 16 MiB staging slab, which the engine wrote past into
decode's memory; it now moves in batches that fit the slab, and the greedy tokens equal monolithic
vLLM's with every block read."""

from __future__ import annotations

import random

import pytest

from pdmesh.client import generate, make_request
from pdmesh.cluster import LocalCluster
from pdmesh.models.tiny import ensure_llama_wide
from tests.conftest import TEST_MODELS_DIR
from tests.e2e.conftest import settled_stats, worker_stats
from worker.baseline import run_in_subprocess

pytestmark = pytest.mark.vllm
PROMPT = [0] + [random.Random(30).randrange(3, 1000) for _ in range(2047)]
MAX_TOKENS = 8
PREFILL_ARGS = ["--engine.max_num_batched_tokens", "4096",   # the prompt in one step
                "--layerwise_read_bytes", str(64 << 20)]     # its layers announced once, when it is done


@pytest.fixture(scope="module")
def wide_dir():
    return ensure_llama_wide(TEST_MODELS_DIR / "tiny-llama-wide")


@pytest.fixture(scope="module")
def wide_reference(wide_dir, tmp_path_factory) -> list[int]:
    runs = run_in_subprocess(wide_dir, [{"prompts": [PROMPT], "sampling": {"max_tokens": MAX_TOKENS,
                                                                           "temperature": 0.0}}],
                             tmp_path_factory.mktemp("wide-reference"))
    return runs["runs"][0]["token_ids"][0]


@pytest.fixture(scope="module")
def wide_mesh(wide_dir, wide_reference, tmp_path_factory):
    with LocalCluster(wide_dir, tmp_path_factory.mktemp("wide-mesh"),
                      worker_args=["--kv_transport", "mooncake", "--mooncake_host", "127.0.0.1",
                                   "--kv_faults.stall_request_prefix", "stall-", "--kv_faults.stall_s", "5"],
                      prefill_args=PREFILL_ARGS, gateway_args=["--kv_flow", "layerwise"]) as running:
        yield running


async def test_a_long_prompt_of_wide_blocks_lands_whole_over_mooncake(wide_mesh, wide_reference):
    token_ids, _, last = await generate(wide_mesh.gateway_address, make_request(PROMPT, max_tokens=MAX_TOKENS,
                                                                                 request_id="stall-wide"))
    assert token_ids == wide_reference
    assert (last.transfer.layerwise, last.transfer.num_blocks) == (True, 64)
    assert last.transfer.num_bytes == 64 * (512 << 10)
    decode = await worker_stats(wide_mesh.decode_addresses[0])
    assert decode.kv_failed_blocks == 0   # every block read, none recomputed
    prefill = await settled_stats(wide_mesh.prefill_addresses[0])
    assert prefill.num_held_transfers == 0

"""The soak (bench/soak.py) for two minutes: 64 streams on the campaign's mesh with the workers'
default timeouts, no faults. Between a quiet checkpoint after the warm-up and one at the end no
process grows (memory, descriptors), no worker keeps a KV block, transfer or pinned block, Redis
keeps no key of an evicted block, and every request completes with monolithic vLLM's tokens. The
report's soak runs 30 minutes."""

from __future__ import annotations

import asyncio

import pytest

from bench.fault_campaign.mesh import FaultMesh
from bench.fault_campaign.soak import run_soak
from bench.fault_campaign.workload import build_workload
from bench.soak import NUM_PREFIXES, soak_spec

pytestmark = [pytest.mark.vllm, pytest.mark.faults]


@pytest.fixture(scope="module")
def mesh(tiny_llama_dir, tmp_path_factory):
    with FaultMesh(soak_spec(tiny_llama_dir, tmp_path_factory.mktemp("soak"))) as running:
        yield running


def test_two_minutes_of_64_streams_lose_nothing_and_leave_the_mesh_as_it_was(mesh, tiny_llama_dir,
                                                                             tmp_path_factory):
    workload = build_workload(tiny_llama_dir, tmp_path_factory.mktemp("soak-reference"), num_prefixes=NUM_PREFIXES)
    result = asyncio.run(run_soak(mesh, workload, seconds=120, num_streams=64, warmup_s=20, sample_every_s=5))
    failed = [check for check in result.checks if not check.passed]
    assert not failed, f"{failed}\n{result.not_completed}"
    assert len(result.samples) >= 6 and result.requests > 64   # a sample takes seconds under this load
    assert set(result.end.processes) == {"gateway", "prefill-0", "prefill-1", "decode-0", "decode-1"}

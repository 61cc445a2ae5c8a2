"""Each fault of the campaign (bench/faults.py), injected a few times into a real mesh under a
16-stream load: every request completes with monolithic vLLM's tokens or fails with a clear status,
none hangs or goes wrong, and no worker holds anything afterwards. The report's campaign runs 100
trials of each; this keeps the path tested."""

from __future__ import annotations

import asyncio

import pytest

from bench.fault_campaign.campaign import run_fault
from bench.fault_campaign.faults import all_faults
from bench.fault_campaign.mesh import FaultMesh, MeshSpec
from bench.fault_campaign.workload import build_workload

pytestmark = [pytest.mark.vllm, pytest.mark.faults]
TRIALS = 2
FAULTS = {fault.name: fault for fault in all_faults()}


@pytest.fixture(scope="module")
def workload(tiny_llama_dir, tmp_path_factory):
    return build_workload(tiny_llama_dir, tmp_path_factory.mktemp("reference"))


@pytest.fixture(scope="module")
def mesh(tiny_llama_dir, tmp_path_factory):
    with FaultMesh(MeshSpec(tiny_llama_dir, tmp_path_factory.mktemp("faults"))) as running:
        yield running


@pytest.mark.parametrize("fault_name", list(FAULTS))
def test_every_request_completes_right_or_fails_clearly_and_nothing_leaks(mesh, workload, fault_name):
    result = asyncio.run(run_fault(mesh, workload, FAULTS[fault_name], TRIALS))
    if result.skipped:
        pytest.skip(result.skipped)
    summary = f"{result.as_json()}\n{mesh.cluster.logs()[-3000:] if not result.meets_goal else ''}"
    assert result.trials == TRIALS and result.requests_hit > 0, summary
    assert result.outcomes["hung"] == result.outcomes["wrong"] == result.outcomes["failed_unclear"] == 0, summary
    assert result.leaks == [], summary
    assert result.trials_hit >= 1, summary   # the fault landed where it is meant to at least once

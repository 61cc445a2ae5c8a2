"""Each fault of the campaign (bench/faults.py), injected a few times into a real mesh under a
16-stream load: every request completes with monolithic vLLM's tokens or fails with a clear status,
none hangs or goes wrong, no worker holds anything afterwards, and tenant B's probe never reuses
tenant A's KV. The report's campaign runs 100 trials of each; this keeps the path tested."""

from __future__ import annotations

import asyncio

import pytest

from bench.fault_campaign.campaign import run_fault
from bench.fault_campaign.faults import all_faults
from bench.fault_campaign.mesh import LOAD_TENANT, FaultMesh, MeshSpec
from bench.fault_campaign.outcomes import cross_tenant_hits
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
    assert result.cross_tenant_hits == 0 and result.probes_judged > 0, summary
    assert result.trials_hit >= 1, summary   # the fault landed where it is meant to at least once


def test_the_probe_sent_as_the_load_tenant_reuses_its_kv(mesh, workload):
    """The isolation check's control: the same probe in tenant A's cache, without salts of its own,
    reuses the prefixes A's streams stored: the hits it counts are real."""
    async def probe_as_tenant_a():
        async with mesh.stream_load(workload, num_streams=4, probe=LOAD_TENANT) as load:
            await asyncio.sleep(20)
        return cross_tenant_hits(load.results)

    num_judged, num_hits = asyncio.run(probe_as_tenant_a())
    assert num_hits > 0, (num_judged, num_hits)

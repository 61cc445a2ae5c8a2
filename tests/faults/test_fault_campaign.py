"""Each fault of the campaign (bench/faults.py), injected a few times into a real mesh under a
16-stream load: every request completes with monolithic vLLM's tokens or fails with a clear status,
none hangs or goes wrong, no worker holds anything afterwards, and tenant B's probe never reuses
tenant A's KV. The report's campaign runs 100 trials of each; this keeps the path tested. Each
fault runs over the KV transport the campaign gives it (auto, grpc for the KV proxy's faults): one
mesh at a time, the auto faults first."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from bench.fault_campaign.campaign import run_fault
from bench.fault_campaign.faults import Fault, Trial, all_faults
from bench.fault_campaign.mesh import LOAD_TENANT, FaultMesh, MeshSpec
from bench.fault_campaign.outcomes import cross_tenant_hits
from bench.fault_campaign.workload import build_workload
from bench.faults import run_faults, transport_of

pytestmark = [pytest.mark.vllm, pytest.mark.faults]
TRIALS = 2
FAULTS = {fault.name: fault for fault in all_faults()}
BY_TRANSPORT = sorted(FAULTS, key=lambda name: transport_of(FAULTS[name], None) != "auto")   # auto first


@pytest.fixture(scope="module")
def workload(tiny_llama_dir, tmp_path_factory):
    return build_workload(tiny_llama_dir, tmp_path_factory.mktemp("reference"))


class OneMeshAtATime:
    """The campaign's mesh over the KV transport a test asks for; asking for another stops the one
    running first (two meshes' engines would share the 2 cores)."""

    def __init__(self, model_dir: Path, tmp_path_factory) -> None:
        self._model_dir, self._tmp_path_factory = model_dir, tmp_path_factory
        self._mesh: FaultMesh | None = None

    def over(self, kv_transport: str) -> FaultMesh:
        if self._mesh is not None and self._mesh.spec.kv_transport != kv_transport:
            self.close()
        if self._mesh is None:
            run_dir = self._tmp_path_factory.mktemp(f"faults-{kv_transport}")
            self._mesh = FaultMesh(MeshSpec(self._model_dir, run_dir, kv_transport=kv_transport)).__enter__()
        return self._mesh

    def running(self) -> FaultMesh:
        """The mesh running now, whatever its transport (the default's if none)."""
        return self._mesh or self.over("auto")

    def close(self) -> None:
        if self._mesh is not None:
            mesh, self._mesh = self._mesh, None
            mesh.__exit__(None, None, None)


@pytest.fixture(scope="module")
def meshes(tiny_llama_dir, tmp_path_factory):
    meshes = OneMeshAtATime(tiny_llama_dir, tmp_path_factory)
    try:
        yield meshes
    finally:
        meshes.close()


@pytest.mark.parametrize("fault_name", BY_TRANSPORT)
def test_every_request_completes_right_or_fails_clearly_and_nothing_leaks(meshes, workload, fault_name):
    mesh = meshes.over(transport_of(FAULTS[fault_name], None))
    result = asyncio.run(run_fault(mesh, workload, FAULTS[fault_name], TRIALS))
    if result.skipped:
        pytest.skip(result.skipped)
    summary = f"{result.as_json()}\n{mesh.cluster.logs()[-3000:] if not result.meets_goal else ''}"
    assert result.trials == TRIALS and result.requests_on_victim > 0 and len(result.outages_s) == TRIALS, summary
    assert result.kv_transport == mesh.spec.kv_transport and result.run_at, summary
    assert result.outcomes["hung"] == result.outcomes["wrong"] == result.outcomes["failed_unclear"] == 0, summary
    assert result.leaks == [], summary
    assert result.cross_tenant_hits == 0 and result.probes_judged > 0, summary
    assert result.trials_hit >= 1, summary   # the fault landed where it is meant to at least once


def test_the_probe_sent_as_the_load_tenant_reuses_its_kv(meshes, workload):
    """The isolation check's control: the same probe in tenant A's cache, without salts of its own,
    reuses the prefixes A's streams stored: the hits it counts are real."""
    mesh = meshes.running()

    async def probe_as_tenant_a():
        async with mesh.stream_load(workload, num_streams=4, probe=LOAD_TENANT) as load:
            await asyncio.sleep(20)
        return cross_tenant_hits(load.results)

    num_judged, num_hits = asyncio.run(probe_as_tenant_a())
    assert num_hits > 0, (num_judged, num_hits)


class RecoveryFails(Fault):
    """Hits nothing; its second recovery fails, as a worker that cannot start again would."""
    name, description = "recovery_fails", "a fault whose second recovery fails"

    def __init__(self) -> None:
        self.num_recovered = 0

    def inject(self, mesh, index):
        return Trial(time.monotonic(), "nobody", hit=False)

    def recover(self, mesh, trial):
        if self.num_recovered == 1:
            raise RuntimeError("prefill-0 did not start")
        self.num_recovered += 1


def test_a_fault_the_mesh_cannot_recover_from_keeps_its_row_and_skips_the_rest(meshes, workload):
    results = asyncio.run(run_faults(meshes.running(), workload, [RecoveryFails(), FAULTS["restart_redis"]],
                                     trials=3, num_streams=4))
    stopped, skipped = results
    assert (stopped.stopped, stopped.trials) == ("trial 1: RuntimeError: prefill-0 did not start", 2)
    assert stopped.requests > 0 and stopped.outcomes["hung"] == stopped.outcomes["wrong"] == 0
    assert not stopped.meets_goal
    assert skipped.skipped == "recovery_fails stopped the mesh" and skipped.requests == 0

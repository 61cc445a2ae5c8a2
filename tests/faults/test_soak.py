"""The soak (bench/soak.py) for two minutes: 64 streams on the campaign's mesh with the workers'
default timeouts, no faults. Between a quiet checkpoint after the warm-up and one at the end no
process grows (memory, descriptors), no worker keeps a KV block, transfer or pinned block, Redis
keeps no key of an evicted block, and every request completes with monolithic vLLM's tokens. The
report's soak runs 30 minutes.

The prefill workers' memory is the soak's open defect (bench/REPORT.md, Soak): their PSS grows
under this load (+5.8% to +7.2% in these two minutes on 2026-12-05, also at the last commit whose
CI passed it; +11% in 7 minutes). Its check is an expected failure until that is fixed; every other
check, the decode workers' and the gateway's memory included, must pass."""

from __future__ import annotations

import asyncio

import pytest

from bench.fault_campaign.mesh import FaultMesh
from bench.fault_campaign.soak import run_soak
from bench.fault_campaign.workload import build_workload
from bench.soak import NUM_PREFIXES, soak_spec

pytestmark = [pytest.mark.vllm, pytest.mark.faults]
PREFILL_MEMORY = {"prefill-0 memory flat", "prefill-1 memory flat"}


@pytest.fixture(scope="module")
def soak(tiny_llama_dir, tmp_path_factory):
    with FaultMesh(soak_spec(tiny_llama_dir, tmp_path_factory.mktemp("soak"))) as mesh:
        workload = build_workload(tiny_llama_dir, tmp_path_factory.mktemp("soak-reference"),
                                  num_prefixes=NUM_PREFIXES)
        return asyncio.run(run_soak(mesh, workload, seconds=120, num_streams=64, warmup_s=20, sample_every_s=5))


def test_two_minutes_of_64_streams_lose_nothing_and_leave_the_mesh_as_it_was(soak):
    failed = [check for check in soak.checks if not check.passed and check.name not in PREFILL_MEMORY]
    assert not failed, f"{failed}\n{soak.not_completed}"
    assert len(soak.samples) >= 6 and soak.requests > 64   # a sample takes seconds under this load
    assert set(soak.end.processes) == {"gateway", "prefill-0", "prefill-1", "decode-0", "decode-1"}
    assert {check.name for check in soak.checks} >= PREFILL_MEMORY


@pytest.mark.xfail(reason="open defect: the prefill workers' PSS grows under the soak's load (bench/REPORT.md)",
                   strict=False)
def test_the_prefill_workers_memory_stays_flat(soak):
    failed = [check for check in soak.checks if not check.passed and check.name in PREFILL_MEMORY]
    assert not failed, failed

"""The typed engine calls name the extension's methods as worker_ext defines them, and unpack
the answers: an engine whose collective_rpc dispatches to a real PDMeshWorkerExtension (the
connector's worker faked: no vLLM engine here)."""

from __future__ import annotations

import pytest

from pdmesh.v1 import common_pb2
from worker.vllm_ext import engine_core_ext, worker_ext
from worker.vllm_ext.engine_calls import EngineCalls, SchedulerStats

COMPAT = common_pb2.CompatInfo(model_fingerprint="fp", block_size=32, num_layers=4)


class _ConnectorWorker:
    compat = COMPAT
    released: list[str] = []

    def counters(self) -> dict:
        return {"kv_blocks_sent": 7}

    def spill_store(self, tier: str) -> int | None:
        return 3 if tier == "nvme" else None

    def release_transfer(self, transfer_id: str) -> bool:
        self.released.append(transfer_id)
        return True

    def release_request(self, request_id: str) -> int:
        return 2


class _Engine:
    """collective_rpc as vLLM runs it: the named method of each rank's worker extension."""

    def __init__(self) -> None:
        self.ranks = [worker_ext.PDMeshWorkerExtension(), worker_ext.PDMeshWorkerExtension()]
        self.engine_core = self

    async def collective_rpc(self, method: str, args: tuple = ()) -> list:
        return [getattr(rank, method)(*args) for rank in self.ranks]

    async def call_utility_async(self, method: str):
        assert method == engine_core_ext.METHOD_NAME
        return {"num_running_requests": 1, "num_waiting_requests": 2, "kv_cache_usage": 0.25, "num_kv_blocks": 64,
                "engine_quiet_steps": 5, "prefill_tokens_per_s": 2500.0, "decode_step_s": 0.02}


@pytest.fixture
def calls(monkeypatch):
    monkeypatch.setattr(worker_ext, "_connector_worker", lambda: _ConnectorWorker())
    return EngineCalls(_Engine())


async def test_each_call_reaches_the_method_of_its_name_and_comes_back_typed(calls):
    assert await calls.compat() == COMPAT
    assert await calls.counters() == {"kv_blocks_sent": 7}
    assert (await calls.spill_store("nvme"), await calls.spill_store("dram")) == (3, None)
    assert await calls.release_transfer("t-1") is True and _ConnectorWorker.released[-1] == "t-1"
    assert await calls.release_request("r-1") == 2
    assert await calls.scheduler_stats() == SchedulerStats(1, 2, 0.25, 64, 5, 2500.0, 0.02)


async def test_a_workers_stats_answer_carries_every_field_the_engine_reports(calls, monkeypatch):
    """GetStats builds WorkerStats from the connector's counters and the scheduler's stats whole:
    a field the engine reports that WorkerStats lacks would fail every call."""
    from worker.runtime import WorkerInfoServicer

    servicer = WorkerInfoServicer(None, _Engine())
    stats = await servicer.GetStats(None, None)
    assert (stats.kv_blocks_sent, stats.num_running_requests, stats.prefill_tokens_per_s, stats.decode_step_s) == (
        7, 1, 2500.0, 0.02)

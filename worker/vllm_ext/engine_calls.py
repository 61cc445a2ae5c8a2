"""The worker process's calls into its engine's other processes, typed. The model workers'
methods (worker_ext.py, through vLLM's collective_rpc: every rank answers) and the engine core's
scheduler query (engine_core_ext.py, through vLLM's utility call) are named here and nowhere else.

Each collective_rpc keeps vLLM's model workers polling their queue a while: nothing here is
meant to be called on a timer (worker/engine_stats.py calls `counters` on a metrics scrape)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from pdmesh.v1 import common_pb2
from worker.vllm_ext.engine_core_ext import scheduler_stats


@dataclass(frozen=True)
class SchedulerStats:
    """The engine's scheduler right now (vLLM reports it only with a step's outputs, stale when idle)."""

    num_running_requests: int
    num_waiting_requests: int
    kv_cache_usage: float
    num_kv_blocks: int
    engine_quiet_steps: int
    prefill_tokens_per_s: float   # the engine's measured prompt rate (worker/compute_rate.py)
    decode_step_s: float          # its decoding steps' time: its streams' TPOT (worker/step_time.py)


class EngineCalls:
    def __init__(self, engine) -> None:
        """engine: vLLM's AsyncLLM, built with worker_ext.PDMeshWorkerExtension."""
        self._engine = engine

    async def compat(self) -> common_pb2.CompatInfo:
        """The KV layout of rank 0's cache."""
        return common_pb2.CompatInfo.FromString(await self._first("pdmesh_compat"))

    async def counters(self) -> dict[str, Any]:
        """Rank 0's connector counters, named as pdmesh.v1.WorkerStats's fields."""
        return await self._first("pdmesh_counters")

    async def spill_store(self, tier: str) -> int | None:
        """Blocks moved down into the KV store's `tier`; None without a store or such a tier."""
        return await self._first("pdmesh_store_spill", tier)

    async def release_transfer(self, transfer_id: str) -> bool:
        """Frees a transfer no decode will read."""
        return await self._first("pdmesh_release_transfer", transfer_id)

    async def release_request(self, request_id: str) -> int:
        """Frees the KV a cancelled prefill request holds (or will hold once its engine registers it)."""
        return await self._first("pdmesh_release_request", request_id)

    async def freeze_gc(self) -> list[tuple[int, float]]:
        """Each rank's (objects frozen, seconds of the full collection before the freeze)."""
        return [tuple(answer) for answer in await self._engine.collective_rpc("pdmesh_freeze_gc")]

    async def dist_stores(self) -> list[str]:
        """Each rank's torch.distributed FileStore ('' for a TCP rendezvous)."""
        return list(await self._engine.collective_rpc("pdmesh_dist_store"))

    async def scheduler_stats(self) -> SchedulerStats:
        values = await scheduler_stats(self._engine)
        return SchedulerStats(**{f.name: values[f.name] for f in fields(SchedulerStats)})

    async def _first(self, method: str, *args) -> Any:
        return (await self._engine.collective_rpc(method, args=args))[0]

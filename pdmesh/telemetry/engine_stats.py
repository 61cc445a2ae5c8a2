"""Feeds a worker's metrics from its vLLM engine: scheduler stats through a vLLM stat logger,
KV counters of the connector (which lives in the engine's worker process) by polling."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from vllm.v1.metrics.loggers import StatLoggerBase

from pdmesh.telemetry.metrics import MeshMetrics

logger = logging.getLogger(__name__)


def stat_logger_factory(metrics: MeshMetrics, block_nbytes_holder: list[int]):
    """vLLM builds stat loggers before the KV layout is known; the holder gets it later."""

    class EngineStatLogger(StatLoggerBase):
        def __init__(self, vllm_config, engine_index: int = 0) -> None:
            self._cache_config = vllm_config.cache_config

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0) -> None:
            if scheduler_stats is None:
                return
            metrics.queue_depth.labels(metrics.role).set(scheduler_stats.num_waiting_reqs)
            metrics.running.labels(metrics.role).set(scheduler_stats.num_running_reqs)
            num_blocks = self._cache_config.num_gpu_blocks or 0
            occupancy = scheduler_stats.kv_cache_usage * num_blocks * (block_nbytes_holder[0] if block_nbytes_holder else 0)
            metrics.tier_occupancy.labels(metrics.role, "device").set(occupancy)

        def log_engine_initialized(self) -> None:
            return None

    return EngineStatLogger


class ConnectorCounterPoller:
    """Adds the connector's KV-sent bytes to the metrics every `interval_s`."""

    def __init__(self, engine, metrics: MeshMetrics, interval_s: float = 1.0) -> None:
        self._engine = engine
        self._metrics = metrics
        self._interval_s = interval_s
        self._last_bytes_sent = 0
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def poll_once(self) -> None:
        counters = (await self._engine.collective_rpc("pdmesh_counters"))[0]
        delta = counters["kv_bytes_sent"] - self._last_bytes_sent
        if delta > 0:
            self._metrics.kv_bytes.labels(self._metrics.role, "sent", "grpc").inc(delta)
            self._last_bytes_sent = counters["kv_bytes_sent"]

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            try:
                await self.poll_once()
            except Exception:  # noqa: BLE001 - metrics must never take the worker down
                logger.warning("polling connector counters failed", exc_info=True)

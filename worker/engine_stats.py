"""Feeds a worker's metrics from its vLLM engine: scheduler stats through a vLLM stat logger,
KV counters of the connector (which lives in the engine's worker process) by polling."""

from __future__ import annotations

import asyncio
import logging

from vllm.v1.metrics.loggers import StatLoggerBase

from pdmesh.telemetry.metrics import MeshMetrics
from worker.vllm_ext.engine_calls import EngineCalls

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


class ConnectorCounterSync:
    """Adds the connector's KV-sent bytes (kept in the engine's worker process) to the metrics,
    on each scrape rather than on a timer: every collective_rpc keeps vLLM's worker busy-polling
    its message queue for a second, so a 1 s timer held a core at 100% on an idle worker."""

    def __init__(self, engine, metrics: MeshMetrics, timeout_s: float = 2.0) -> None:
        self._calls = EngineCalls(engine)
        self._metrics = metrics
        self._timeout_s = timeout_s
        self._last: dict[str, int] = {}  # counter name: value at the previous scrape

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Refresh on every scrape; the engine client lives on `loop`, the scrape runs elsewhere."""
        self._metrics.on_scrape(lambda: self._refresh_from_thread(loop))

    async def poll_once(self) -> None:
        counters = await self._calls.counters()
        m, role = self._metrics, self._metrics.role
        for transport, num_bytes in counters.get("kv_bytes_sent_by_transport", {}).items():
            self._add_delta(f"kv_bytes_sent_{transport}", num_bytes, m.kv_bytes.labels(role, "sent", transport))
        for name, counter in (("kv_store_corrupt_blocks", m.store_corrupt_blocks.labels(role)),
                              ("kv_store_blocks_saved", m.store_blocks_saved.labels(role))):
            self._add_delta(name, counters.get(name, 0), counter)
        for tier, num_bytes in counters.get("kv_store_occupancy_bytes", {}).items():
            m.tier_occupancy.labels(role, f"store_{tier}").set(num_bytes)

    def _add_delta(self, name: str, value: int, counter) -> None:
        """Adds to `counter` what the worker's running total `name` grew by since the last scrape."""
        delta = value - self._last.get(name, 0)
        if delta > 0:
            counter.inc(delta)
            self._last[name] = value

    def _refresh_from_thread(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            asyncio.run_coroutine_threadsafe(self.poll_once(), loop).result(timeout=self._timeout_s)
        except Exception:  # noqa: BLE001 - a scrape must never take the worker down
            logger.warning("reading connector counters failed", exc_info=True)

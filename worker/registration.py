"""A worker's entry in the registry: its record, kept alive with the engine's current load."""

from __future__ import annotations

import asyncio
import logging
import time

from pdmesh.config import WorkerSettings
from pdmesh.registry import RegistryPublisher, WorkerLoad, WorkerRecord
from pdmesh.v1 import worker_pb2
from worker.vllm_ext.engine_calls import EngineCalls

logger = logging.getLogger(__name__)


class WorkerRegistration:
    """Publishes the worker's record; a task reads the engine's scheduler each heartbeat for the load.

    The read runs apart from the heartbeat on purpose: a utility call waits for the engine's current
    step, and a long step must not delay a beat past the record's TTL (the beat sends the last load)."""

    def __init__(self, settings: WorkerSettings, engine, info: worker_pb2.WorkerInfoResponse, address: str) -> None:
        self._settings = settings
        self._calls = EngineCalls(engine)
        self._info = info
        self._address = address
        self._load = WorkerLoad()
        self._publisher: RegistryPublisher | None = None
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        stats = await self._calls.scheduler_stats()
        info, settings = self._info, self._settings
        record = WorkerRecord(role=settings.role, address=self._address, kv_address=info.kv_address, model=info.model,
                              model_fingerprint=info.compat.model_fingerprint,
                              max_num_seqs=settings.engine.max_num_seqs, num_kv_blocks=stats.num_kv_blocks,
                              started_at=time.time(), updated_at=time.time())
        self._publisher = RegistryPublisher(settings.registry, record, load=lambda: self._load,
                                            mesh_token=settings.mesh_token)
        self._task = asyncio.create_task(self._refresh_load())
        await self._publisher.start()

    async def stop(self) -> None:
        """Leaves the registry at once (the gateway stops routing here before the server drains)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._publisher is not None:
            await self._publisher.stop(deregister=True)

    async def _refresh_load(self) -> None:
        while True:
            try:
                stats = await self._calls.scheduler_stats()
                self._load = WorkerLoad(stats.num_running_requests, stats.num_waiting_requests, stats.kv_cache_usage,
                                        stats.prefill_tokens_per_s, stats.decode_step_s)
            except Exception:  # noqa: BLE001 - a stale load is better than no heartbeat
                logger.warning("reading the engine's load failed", exc_info=True)
            await asyncio.sleep(self._settings.registry.heartbeat_s)

"""The worker side: keeps this worker's record alive in Redis until stopped."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from pdmesh.background import cancel_task, wait_or_cancel
from pdmesh.config import RegistrySettings
from pdmesh.mesh_signing import REGISTRY_PURPOSE, signer_for
from pdmesh.registry.keys import delete_record, record_key, write_record
from pdmesh.registry.record import WorkerRecord, seal_record
from pdmesh.registry.redis_client import SOCKET_TIMEOUT_S, OutageLog, connect

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerLoad:
    """What a worker's engine reports each beat (from its scheduler stats)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0      # 0..1
    prefill_tokens_per_s: float = 0.0   # its measured prompt rate (0: unknown)
    decode_step_s: float = 0.0          # its decoding steps' time, the TPOT its streams see (0: unknown)


class RegistryPublisher:
    """Writes the record with its TTL every `heartbeat_s`; a failed write is logged (once per outage),
    counted and retried at the next beat, so a restarted, empty Redis has it back one beat later.
    With the mesh token every write is signed (with its key), as gateways holding the token require."""

    def __init__(self, settings: RegistrySettings, record: WorkerRecord,
                 load: Callable[[], WorkerLoad] | None = None, mesh_token: str | None = None) -> None:
        self.settings = settings
        self._signer = signer_for(mesh_token, REGISTRY_PURPOSE)
        self.record = WorkerRecord()
        self.record.CopyFrom(record)
        self.key = record_key(settings.prefix, record.role, record.address)
        self._load = load
        self._client: aioredis.Redis | None = None
        self._task: asyncio.Task | None = None
        self._stopping = asyncio.Event()
        self._redis_log = OutageLog(f"registry heartbeat of {self.key}")
        self._load_log = OutageLog(f"load callback of {self.key}")
        self.num_beats = 0           # successful writes

    @property
    def num_errors(self) -> int:
        return self._redis_log.num_errors

    @property
    def running(self) -> bool:
        """True while the heartbeat task is alive."""
        return self._task is not None and not self._task.done()

    async def start(self) -> None:
        """Writes the record now (a failure is logged, not raised) and starts the heartbeat."""
        if self._task is not None:
            raise RuntimeError("publisher already started")
        self._client = connect(self.settings, "pdmesh-registry-publisher")
        self._stopping.clear()
        try:
            await self.beat()
        except BaseException:
            await self._close()
            raise
        self._task = asyncio.create_task(self._heartbeat(), name=f"registry-heartbeat {self.key}")

    async def stop(self, deregister: bool = True) -> None:
        """Stops the heartbeat; deregister=True deletes the record (gone at once), False leaves it to
        expire after ttl_s (what a crash looks like). Closes the client."""
        if self._task is not None:
            if deregister:
                self._stopping.set()          # let a write in flight finish before the delete
                await wait_or_cancel(self._task, SOCKET_TIMEOUT_S * 3)
            else:
                await cancel_task(self._task)
            self._task = None
        if self._client is not None and deregister:
            try:
                await delete_record(self._client, self.settings.prefix, self.key)
            except (RedisError, OSError) as exc:
                self._redis_log.failed(exc)
        await self._close()

    async def beat(self) -> bool:
        """Refreshes the load and updated_at and writes the record with its TTL (after start); False
        on a Redis error."""
        load = self._current_load()
        self.record.num_running, self.record.num_waiting = load.num_running, load.num_waiting
        self.record.kv_cache_usage, self.record.updated_at = load.kv_cache_usage, time.time()
        self.record.prefill_tokens_per_s, self.record.decode_step_s = load.prefill_tokens_per_s, load.decode_step_s
        try:
            await write_record(self._client, self.settings.prefix, self.key,
                               seal_record(self.record, self.key, self._signer),
                               max(1, int(self.settings.ttl_s * 1000)))
        except (RedisError, OSError) as exc:
            self._redis_log.failed(exc)
            return False
        self._redis_log.succeeded()
        self.num_beats += 1
        return True

    async def _heartbeat(self) -> None:
        while not await _wait_event(self._stopping, self.settings.heartbeat_s):
            try:
                await self.beat()
            except Exception:  # noqa: BLE001 - the heartbeat must outlive any bug in one beat
                logger.exception("registry heartbeat of %s failed unexpectedly", self.key)

    def _current_load(self) -> WorkerLoad:
        """The load callback's answer; the last known load when there is none or it fails."""
        last = WorkerLoad(self.record.num_running, self.record.num_waiting, self.record.kv_cache_usage,
                          self.record.prefill_tokens_per_s, self.record.decode_step_s)
        if self._load is None:
            return last
        try:
            load = self._load()
        except Exception as exc:  # noqa: BLE001 - a failing stats read must not stop the heartbeat
            self._load_log.failed(exc)
            return last
        self._load_log.succeeded()
        return load

    async def _close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None


async def _wait_event(event: asyncio.Event, timeout_s: float) -> bool:
    """True when the event is set within timeout_s, False when the time ran out."""
    try:
        await asyncio.wait_for(event.wait(), timeout_s)
    except TimeoutError:
        return False
    return True

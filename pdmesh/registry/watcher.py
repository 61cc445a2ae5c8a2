"""The gateway side: re-reads the registry every `poll_s` into a snapshot of the pool. While Redis is
unreachable the last snapshot stays (the gateway's own failure detection removes dead workers).
A record under a key not its own is ignored and counted (num_rejected); with the mesh token, so is
one without the workers' signature: a write to Redis alone cannot add or impersonate a worker."""

from __future__ import annotations

import asyncio
import logging

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from pdmesh.background import cancel_task
from pdmesh.config import RegistrySettings
from pdmesh.mesh_signing import REGISTRY_PURPOSE, signer_for
from pdmesh.registry.keys import read_records
from pdmesh.registry.record import UntrustedRecord, WorkerRecord, open_record
from pdmesh.registry.redis_client import OutageLog, connect

logger = logging.getLogger(__name__)


class RegistryWatcher:
    def __init__(self, settings: RegistrySettings, mesh_token: str | None = None) -> None:
        """mesh_token: the workers' signing secret; None reads records unsigned (as they are written then)."""
        self.settings = settings
        self._signer = signer_for(mesh_token, REGISTRY_PURPOSE)
        self.workers: dict[str, WorkerRecord] = {}   # address → its latest record
        self.num_polls = 0           # successful reads
        self.num_malformed = 0       # values skipped, counted at every read that met them
        self.num_rejected = 0        # well-formed values not believed (signature, key), counted the same way
        self._client: aioredis.Redis | None = None
        self._task: asyncio.Task | None = None
        self._redis_log = OutageLog("registry poll")
        self._skipped_logged: set[tuple[str, bytes]] = set()

    @property
    def num_errors(self) -> int:
        return self._redis_log.num_errors

    @property
    def reachable(self) -> bool:
        """False while Redis is failing (the snapshot is then the last one read)."""
        return not self._redis_log.down

    def snapshot(self, role: str | None = None) -> list[WorkerRecord]:
        """The known workers (of one role, if given), sorted by address."""
        return [self.workers[a] for a in sorted(self.workers) if role is None or self.workers[a].role == role]

    async def start(self) -> None:
        """Reads once (so the pool is populated on return; a failure is logged) and starts polling."""
        if self._task is not None:
            raise RuntimeError("watcher already started")
        self._client = connect(self.settings, "pdmesh-registry-watcher")
        await self.refresh()
        self._task = asyncio.create_task(self._poll(), name="registry-watcher")

    async def stop(self) -> None:
        """Stops polling and closes the client; the last snapshot stays readable."""
        if self._task is not None:
            await cancel_task(self._task)
            self._task = None
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def refresh(self) -> bool:
        """One read of the registry now; False (snapshot unchanged) when Redis fails."""
        try:
            values = await read_records(self._client, self.settings.prefix)
        except (RedisError, OSError) as exc:
            self._redis_log.failed(exc)
            return False
        self._redis_log.succeeded()
        self.num_polls += 1
        self.workers = self._parse_all(values)
        return True

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.settings.poll_s)
            try:
                await self.refresh()
            except Exception:  # noqa: BLE001 - polling must outlive any bug in one read
                logger.exception("registry poll failed unexpectedly")

    def _parse_all(self, values: dict[str, bytes]) -> dict[str, WorkerRecord]:
        workers: dict[str, WorkerRecord] = {}
        for key, value in values.items():
            try:
                record = open_record(self.settings.prefix, key, value, self._signer)
            except UntrustedRecord as exc:
                self.num_rejected += 1
                self._log_skipped("untrusted", key, value, exc)
                continue
            except ValueError as exc:
                self.num_malformed += 1
                self._log_skipped("malformed", key, value, exc)
                continue
            workers[record.address] = record
        return workers

    def _log_skipped(self, why: str, key: str, value: bytes, exc: Exception) -> None:
        if (key, value) not in self._skipped_logged:
            self._skipped_logged.add((key, value))
            logger.warning("registry: skipping %s record under %s (%s)", why, key, exc)

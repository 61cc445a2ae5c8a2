"""The worker registry in Redis: workers heartbeat a record with a TTL; gateways watch it.

Each worker writes one key, `<prefix>:<role>:<address>`, holding its `WorkerRecord` as JSON with
`SET ... PX ttl_ms`, every `heartbeat_s`. A worker that stops heartbeating (crash, partition)
disappears after `ttl_s`; one that stops gracefully deletes its key at once. A gateway polls the
keys (`SCAN` + `MGET`) every `poll_s` into a snapshot of the pool.

Redis is never a reason to fail: the publisher logs (once per outage), counts and retries at the
next beat, so a restarted, empty Redis has the record back one beat later; the watcher keeps its
last snapshot while Redis is unreachable (the gateway's own failure detection removes dead workers).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import MISSING, asdict, dataclass, fields, replace
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from pdmesh.config import RegistrySettings

logger = logging.getLogger(__name__)

ROLES = ("prefill", "decode")
SOCKET_TIMEOUT_S = 1.0       # one Redis call; a beat or a poll never blocks longer than about this
SCAN_COUNT = 1000
MGET_BATCH = 1000


@dataclass(frozen=True)
class WorkerLoad:
    """What a worker's engine reports each beat (from its scheduler stats)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0      # 0..1


@dataclass(frozen=True)
class WorkerRecord:
    """One worker as the registry advertises it."""

    role: str                        # "prefill" | "decode"
    address: str                     # host:port of its gRPC API
    kv_address: str                  # the prefill's KV server; "" for a decode worker
    model: str                       # served model name
    model_fingerprint: str
    max_num_seqs: int
    num_kv_blocks: int
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    started_at: float = 0.0          # unix time
    updated_at: float = 0.0          # unix time of the last beat

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> WorkerRecord:
        """Parses a record; extra fields are ignored. Raises ValueError when malformed."""
        try:
            data = json.loads(text)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"not JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        return cls(**{f.name: _field_value(data, f.name, f.type, f.default) for f in fields(cls)})

    def with_load(self, load: WorkerLoad, now: float) -> WorkerRecord:
        return replace(self, num_running=load.num_running, num_waiting=load.num_waiting,
                       kv_cache_usage=load.kv_cache_usage, updated_at=now)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, not {self.role!r}")


_TYPE_CHECKS: dict[str, Callable[[Any], bool]] = {
    "str": lambda v: isinstance(v, str),
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
}


def _field_value(data: dict, name: str, type_name: str, default: Any) -> Any:
    """One field of a parsed record, checked against its type (bool is no number here)."""
    if name not in data:
        if default is MISSING:
            raise ValueError(f"missing field {name!r}")
        return default
    value = data[name]
    if not _TYPE_CHECKS[type_name](value):
        raise ValueError(f"field {name!r} is not {type_name}: {value!r}")
    return float(value) if type_name == "float" else value


def connect(settings: RegistrySettings, client_name: str = "pdmesh-registry",
            timeout_s: float = SOCKET_TIMEOUT_S) -> aioredis.Redis:
    """An asyncio client for the registry: short timeouts, one immediate retry (a restarted Redis),
    named so that CLIENT LIST shows who holds which connection."""
    if not settings.redis_url:
        raise ValueError("RegistrySettings.redis_url is not set")
    return aioredis.Redis.from_url(settings.redis_url, password=settings.redis_password or None,
                                   socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                   retry=Retry(NoBackoff(), 1), client_name=client_name)


def worker_key(prefix: str, role: str, address: str) -> str:
    return f"{prefix}:{role}:{address}"


class _OutageLog:
    """Counts failures; logs the first of an outage and the recovery, not every one."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.num_errors = 0
        self.down = False

    def failed(self, exc: BaseException) -> None:
        self.num_errors += 1
        if not self.down:
            self.down = True
            logger.warning("%s failed (%s: %s); retrying quietly until it works",
                           self.what, type(exc).__name__, exc)

    def succeeded(self) -> None:
        if self.down:
            self.down = False
            logger.info("%s works again", self.what)


class RegistryPublisher:
    """The worker side: keeps this worker's record alive in Redis until stopped."""

    def __init__(self, settings: RegistrySettings, record: WorkerRecord,
                 load: Callable[[], WorkerLoad] | None = None) -> None:
        self.settings = settings
        self.record = record
        self.key = worker_key(settings.prefix, record.role, record.address)
        self._load = load
        self._client: aioredis.Redis | None = None
        self._task: asyncio.Task | None = None
        self._stopping = asyncio.Event()
        self._redis_log = _OutageLog(f"registry heartbeat of {self.key}")
        self._load_log = _OutageLog(f"load callback of {self.key}")
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
                self._stopping.set()          # let a write in flight finish before the DEL
                await _wait_or_cancel(self._task, SOCKET_TIMEOUT_S * 3)
            else:
                await _cancel(self._task)
            self._task = None
        if self._client is not None and deregister:
            await self._delete()
        await self._close()

    async def beat(self) -> bool:
        """Refreshes load and updated_at and writes the record with its TTL (after start); False on a
        Redis error."""
        self.record = self.record.with_load(self._current_load(), time.time())
        try:
            await self._client.set(self.key, self.record.to_json(), px=_ttl_ms(self.settings))
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
        if self._load is None:
            return WorkerLoad(self.record.num_running, self.record.num_waiting, self.record.kv_cache_usage)
        try:
            load = self._load()
        except Exception as exc:  # noqa: BLE001 - a failing stats read must not stop the heartbeat
            self._load_log.failed(exc)
            return WorkerLoad(self.record.num_running, self.record.num_waiting, self.record.kv_cache_usage)
        self._load_log.succeeded()
        return load

    async def _close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def _delete(self) -> None:
        try:
            await self._client.delete(self.key)
        except (RedisError, OSError) as exc:
            self._redis_log.failed(exc)


OnChange = Callable[[list[WorkerRecord]], Awaitable[None] | None]


class RegistryWatcher:
    """The gateway side: polls the registry into `workers` (address → record)."""

    def __init__(self, settings: RegistrySettings, on_change: OnChange | None = None) -> None:
        self.settings = settings
        self.on_change = on_change
        self.workers: dict[str, WorkerRecord] = {}
        self.num_polls = 0           # successful reads
        self.num_malformed = 0       # values skipped, counted at every read that met them
        self.last_read_at: float | None = None   # unix time of the last successful read
        self._client: aioredis.Redis | None = None
        self._task: asyncio.Task | None = None
        self._redis_log = _OutageLog("registry poll")
        self._malformed_logged: set[tuple[str, bytes]] = set()

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
            await _cancel(self._task)
            self._task = None
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def refresh(self) -> bool:
        """One read of the registry now; False (snapshot unchanged) when Redis fails."""
        try:
            values = await self._read_all()
        except (RedisError, OSError) as exc:
            self._redis_log.failed(exc)
            return False
        self._redis_log.succeeded()
        self.num_polls += 1
        self.last_read_at = time.time()
        await self._replace(self._parse_all(values))
        return True

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.settings.poll_s)
            try:
                await self.refresh()
            except Exception:  # noqa: BLE001 - polling must outlive any bug in one read
                logger.exception("registry poll failed unexpectedly")

    async def _read_all(self) -> dict[str, bytes]:
        """Every key under the prefix and its value (keys that expired in between are left out)."""
        keys = [k async for k in self._client.scan_iter(match=f"{self.settings.prefix}:*", count=SCAN_COUNT)]
        keys = sorted(set(keys))
        values: dict[str, bytes] = {}
        for start in range(0, len(keys), MGET_BATCH):
            batch = keys[start:start + MGET_BATCH]
            for key, value in zip(batch, await self._client.mget(batch)):
                if value is not None:
                    values[key.decode(errors="replace")] = value
        return values

    def _parse_all(self, values: dict[str, bytes]) -> dict[str, WorkerRecord]:
        workers: dict[str, WorkerRecord] = {}
        for key, value in values.items():
            try:
                record = WorkerRecord.from_json(value)
            except (ValueError, TypeError) as exc:
                self._skip_malformed(key, value, exc)
                continue
            workers[record.address] = record
        return workers

    def _skip_malformed(self, key: str, value: bytes, exc: Exception) -> None:
        self.num_malformed += 1
        if (key, value) not in self._malformed_logged:
            self._malformed_logged.add((key, value))
            logger.warning("registry: skipping malformed record under %s (%s)", key, exc)

    async def _replace(self, workers: dict[str, WorkerRecord]) -> None:
        changed = workers.keys() != self.workers.keys()
        self.workers = workers
        if changed and self.on_change is not None:
            await self._notify()

    async def _notify(self) -> None:
        try:
            result = self.on_change(self.snapshot())
            if inspect.isawaitable(result):
                await result
        except Exception:  # noqa: BLE001 - a subscriber's bug must not stop the watcher
            logger.exception("registry on_change callback failed")


def _ttl_ms(settings: RegistrySettings) -> int:
    return max(1, int(settings.ttl_s * 1000))


async def _wait_event(event: asyncio.Event, timeout_s: float) -> bool:
    """True when the event is set within timeout_s, False when the time ran out."""
    try:
        await asyncio.wait_for(event.wait(), timeout_s)
    except TimeoutError:
        return False
    return True


async def _cancel(task: asyncio.Task) -> None:
    """Cancels a task and waits for it; a cancellation of the caller itself still propagates."""
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if current is not None and current.cancelling():
            raise


async def _wait_or_cancel(task: asyncio.Task, timeout_s: float) -> None:
    """Lets a task end on its own within timeout_s; cancels it after that."""
    done, _ = await asyncio.wait({task}, timeout=timeout_s)
    if not done:
        await _cancel(task)

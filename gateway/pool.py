"""The gateway's workers: channels, their info, health (cooldown after a failed call), this
gateway's in-flight count on each, and the latest load their registry record reported.

Workers come from the static lists in the config and, with a registry, from Redis: a worker
that joins is added, one whose record expired is removed (its channel closes once its calls end).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import grpc

from gateway.decode_streams import DecodeStreams
from pdmesh.background import BackgroundTasks
from pdmesh.compat import check_readable
from pdmesh.config import TlsSettings
from pdmesh.errors import Incompatible, NoWorkerAvailable
from pdmesh.registry import RegistryWatcher, WorkerRecord
from pdmesh.telemetry.grpc_client import client_span
from pdmesh.tls import open_channel
from pdmesh.v1 import common_pb2, worker_pb2, worker_pb2_grpc

CLOSE_GRACE_S = 30.0  # a removed worker's channel waits this long for its calls to end
BOTH = "both"         # a worker's role when it takes either per request


@dataclass
class Worker:
    address: str
    role: str
    channel: grpc.aio.Channel
    static: bool = False                 # from the config's lists: never removed by the registry
    info: worker_pb2.WorkerInfoResponse | None = None
    record: WorkerRecord | None = None   # latest registry record (its load), if any
    in_flight: int = 0                   # this gateway's calls on it now
    down_until: float = 0.0              # skipped until then (monotonic) after a connection failure
    probe: asyncio.Task | None = None    # asking a worker cooling down whether it is back, shared by waiters
    # Its engine's prompt rate (tokens/s) as it last published it, in an answer or its registry
    # record (worker/compute_rate.py: the one estimator); 0: not known yet.
    prefill_tokens_per_s: float = 0.0
    # Its engine's decoding step time (seconds), the TPOT of every stream it decodes, whichever gateway's,
    # as it last published it (worker/step_time.py); 0: not known yet.
    decode_step_s: float = 0.0
    _streams: DecodeStreams | None = field(default=None, repr=False)

    def decode_streams(self) -> DecodeStreams:
        """The one call this gateway's decodes on the worker share (gateway/decode_streams.py)."""
        if self._streams is None:
            self._streams = DecodeStreams(self.channel)
        return self._streams

    async def close(self, grace_s: float | None = None) -> None:
        """Its calls end (given grace_s, if any, to finish), then its channel closes. The decode
        streams' call never ends by itself: it closes once its streams have (or the grace is over)."""
        started = time.monotonic()
        if self._streams is not None:
            if grace_s is not None:
                await self._streams.wait_idle(grace_s)
            await self._streams.close()
        left_s = None if grace_s is None else max(0.0, grace_s - (time.monotonic() - started))
        await self.channel.close(left_s)

    def published_rate(self, tokens_per_s: float) -> None:
        if tokens_per_s > 0:
            self.prefill_tokens_per_s = tokens_per_s

    def published_step(self, step_s: float) -> None:
        if step_s > 0:
            self.decode_step_s = step_s

    def tpot_s(self) -> float:
        """The TPOT a stream it decodes sees now: its published step time while it serves any request
        (0 when idle: a lone stream's pace is not a batch's)."""
        return self.decode_step_s if self.queue() > 0 else 0.0

    def queue(self) -> int:
        """Requests on it: this gateway's, or what it last reported if more (other gateways' too)."""
        reported = self.record.num_running + self.record.num_waiting if self.record else 0
        return max(self.in_flight, reported)


class WorkerPool:
    def __init__(self, prefill_addresses: list[str], decode_addresses: list[str], tls: TlsSettings | None = None,
                 info_timeout_s: float = 5.0, cooldown_s: float = 5.0, wait_s: float = 0.0,
                 registry: RegistryWatcher | None = None, mesh_token: str | None = None,
                 both_addresses: Iterable[str] = ()) -> None:
        """both_addresses: workers taking either role per request (python -m node)."""
        self._tls = tls or TlsSettings()
        self._mesh_token = mesh_token   # every call to a worker carries it
        self._registry = registry
        self._info_timeout_s = info_timeout_s
        self._cooldown_s = cooldown_s
        self._wait_s = wait_s   # how long a request waits for a worker of a role when none is up
        self._workers: dict[str, Worker] = {}
        self._background = BackgroundTasks()
        for role, addresses in (("prefill", prefill_addresses), ("decode", decode_addresses), (BOTH, both_addresses)):
            for address in addresses:
                self._workers[address] = self._open(address, role, static=True)

    def workers(self, role: str) -> list[Worker]:
        """The workers that can take `role` ("prefill" or "decode"): its own, and those taking both."""
        return [w for w in self._workers.values() if w.role in (role, BOTH)]

    def sync_registry(self, records: Iterable[WorkerRecord]) -> None:
        """Adds workers that joined, refreshes the load of known ones, drops those that left."""
        seen = set()
        for record in records:
            seen.add(record.address)
            worker = self._workers.get(record.address)
            if worker is None:
                worker = self._workers[record.address] = self._open(record.address, record.role)
            worker.record = record
            worker.published_rate(record.prefill_tokens_per_s)
            worker.published_step(record.decode_step_s)
        for address in [a for a, w in self._workers.items() if not w.static and a not in seen]:
            self._background.spawn(self._workers.pop(address).close(CLOSE_GRACE_S))

    async def candidates(self, role: str, avoid: set[str] = frozenset()) -> list[Worker]:
        """Workers of `role` not cooling down whose info is known (asked now if not); those in
        `avoid` (they failed the request asking) only while no other is. When none is up, every
        worker of the role cooling down is asked whether it is back (a restarted one answers within
        a second; one that failed the request counts too: a reset connection fails a request on a
        worker that serves again a moment later), for up to wait_s, before the request fails."""
        if self._registry is not None:
            self.sync_registry(self._registry.snapshot())
        now = time.monotonic()
        workers = [w for w in self.workers(role) if w.down_until <= now]
        ok = await asyncio.gather(*(self._ensure_info(w) for w in workers))
        up = [w for w, has_info in zip(workers, ok) if has_info]
        found = [w for w in up if w.address not in avoid] or up
        if not found and self._wait_s > 0:
            found = await self._first_back(self.workers(role))
        if not found:
            raise NoWorkerAvailable(f"no reachable {role} worker among {[w.address for w in self.workers(role)]}")
        return found

    @staticmethod
    def compatible_with(prefill: Worker, decodes: list[Worker]) -> list[Worker]:
        """The decode workers that can take `prefill`'s KV (Incompatible naming the fields if none)."""
        found, last_error = [], None
        decodes = [d for d in decodes if d.info is not None]   # not marked down since they were listed
        if not decodes:
            raise NoWorkerAvailable("every decode worker went down")
        for decode in decodes:
            try:
                check_readable(prefill.info.compat, decode.info.compat)  # decode may have fewer ranks
                found.append(decode)
            except Incompatible as exc:
                last_error = exc
        if not found:
            raise Incompatible(f"prefill {prefill.address} and decode {decodes[0].address}: {last_error}")
        return found

    def mark_down(self, worker: Worker) -> None:
        worker.down_until = time.monotonic() + self._cooldown_s
        worker.info = None   # asked again when it is back (it may have restarted with another model)

    @contextlib.contextmanager
    def busy(self, worker: Worker) -> Iterator[None]:
        worker.in_flight += 1
        try:
            yield
        finally:
            worker.in_flight -= 1

    async def any_info(self) -> worker_pb2.WorkerInfoResponse:
        """A decode worker's info (the model, its limits). A worker listed may be marked down by
        another request before its info is read: then another's, or NoWorkerAvailable."""
        for worker in await self.candidates("decode"):
            info = worker.info
            if info is not None:
                return info
        raise NoWorkerAvailable("every decode worker went down while this request was checked")

    def release_kv_soon(self, prefill: Worker | None, handle: common_pb2.KVHandle) -> None:
        """Frees a prefill's pinned blocks decode will not take, without waiting (works while cancelled)."""
        if prefill is not None and handle.transfer_id:
            self._background.spawn(self.release_kv(prefill, handle))

    async def release_kv(self, prefill: Worker, handle: common_pb2.KVHandle) -> bool:
        """Best effort, through the prefill worker's own service (the KV port serves mesh peers only);
        False when nothing was held (decode already released it) or prefill is gone."""
        try:
            with client_span("/pdmesh.v1.Prefill/Release") as metadata:
                response = await worker_pb2_grpc.PrefillStub(prefill.channel).Release(
                    worker_pb2.ReleaseKVRequest(transfer_id=handle.transfer_id), timeout=self._info_timeout_s,
                    metadata=metadata)
        except grpc.aio.AioRpcError:
            return False
        return response.released

    async def close(self) -> None:
        await self._background.wait(self._info_timeout_s)
        probes = [w.probe for w in self._workers.values() if w.probe is not None]
        for probe in probes:
            probe.cancel()
        await asyncio.gather(*probes, return_exceptions=True)
        await asyncio.gather(*(w.close() for w in self._workers.values()))

    def _open(self, address: str, role: str, static: bool = False) -> Worker:
        channel = open_channel(address, self._tls, mesh_token=self._mesh_token)  # calls trace themselves
        return Worker(address, role, channel, static=static)

    async def _first_back(self, workers: list[Worker]) -> list[Worker]:
        """The first of `workers` to answer a probe within wait_s (probes are shared: one per worker
        however many requests wait); [] if none does."""
        probes = {self._probe(w): w for w in workers}
        pending = set(probes)
        deadline = time.monotonic() + self._wait_s
        while pending:
            done, pending = await asyncio.wait(pending, timeout=max(0.0, deadline - time.monotonic()),
                                               return_when=asyncio.FIRST_COMPLETED)
            back = [probes[probe] for probe in done if probe.result()]
            if back or not done:
                return back
        return []

    def _probe(self, worker: Worker) -> asyncio.Task:
        if worker.probe is None or worker.probe.done():
            worker.probe = asyncio.create_task(self._is_back(worker))
        return worker.probe

    async def _is_back(self, worker: Worker) -> bool:
        """Asks a worker for its info, waiting for its channel to connect (up to wait_s): back if it
        answers with its role; then it is up again."""
        info = await self._ask_info(worker, self._wait_s, wait_for_ready=True)
        if info is None:
            return False
        worker.info, worker.down_until = info, 0.0
        return True

    async def _ensure_info(self, worker: Worker) -> bool:
        if worker.info is not None:
            return True
        info = await self._ask_info(worker, self._info_timeout_s)
        if info is None:
            self.mark_down(worker)
            return False
        worker.info = info
        return True

    @staticmethod
    async def _ask_info(worker: Worker, timeout_s: float,
                        wait_for_ready: bool = False) -> worker_pb2.WorkerInfoResponse | None:
        """The worker's info, or None if the call failed or it answers as another role."""
        try:
            info = await worker_pb2_grpc.WorkerInfoStub(worker.channel).GetInfo(
                worker_pb2.GetInfoRequest(), timeout=timeout_s, wait_for_ready=wait_for_ready)
        except grpc.aio.AioRpcError:
            return None
        return info if info.role == worker.role else None

"""Engine steps that skip the model workers while every request waits for its KV.

vLLM steps an engine whose requests all wait for remote KV (WAITING_FOR_REMOTE_KVS) once a
millisecond, and each such step is a round trip to every model worker (the scheduler output out
through shared memory, the connector's get_finished back) whose only news can be "a transfer
finished". That round trip kept decode's processes busy for as long as a request waited: in the
layer-wise flow a request waits while prefill computes, and its model worker took 92% of a core
and its engine core 45% (bench/REPORT.md, "Layer-wise KV flow vs pull"), on cores that prefill's
processes need on a shared host. So the workers say it themselves: each sends a datagram to its
engine core when a transfer (a pull or a store load) has finished, and the engine core skips a
step's round trip while
  - every request it holds waits for remote KV (none running, none new, none finished, none
    whose transfer was already reported finished),
  - the connector has nothing for the workers (no new transfer, release or layer-wise step),
  - no worker has said a transfer finished since the last round trip,
  - and the last round trip was less than `max_quiet_s` ago (in case a datagram was lost).
Where the scheduler lacks what this reads (another vLLM version), nothing is skipped.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import time
from typing import Any

logger = logging.getLogger(__name__)

_MAX_DRAIN = 64  # datagrams read per check; one is enough to step


def new_wake_name() -> str:
    """A name for one engine's wake socket (Linux abstract namespace: no file, gone with the process)."""
    return f"pdmesh-wake-{os.getpid()}-{secrets.token_hex(6)}"


def _address(name: str) -> str:
    return "\0" + name


class TransferWakeups:
    """A model worker's side: tells the engine core a transfer has finished."""

    def __init__(self, name: str) -> None:
        self._address = _address(name)
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._socket.setblocking(False)

    def transfer_finished(self) -> None:
        try:
            self._socket.sendto(b"\x01", self._address)
        except OSError:  # no engine core bound yet, or its queue is full: its next round trip still learns
            pass

    def close(self) -> None:
        self._socket.close()


class QuietSteps:
    """The engine core's side: whether this step may skip its workers."""

    def __init__(self, name: str, max_quiet_s: float = 0.1) -> None:
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._socket.bind(_address(name))
        self._socket.setblocking(False)
        self._max_quiet_s = max_quiet_s
        self._last_round_trip = time.monotonic()
        self.num_skipped = 0

    def skip(self, scheduler: Any, connector_has_work: bool) -> bool:
        """True: skip this step (nothing can have changed); False: step (a round trip to the workers)."""
        woken = self._woken()
        quiet = (not woken and not connector_has_work and _all_wait_for_kv(scheduler)
                 and time.monotonic() - self._last_round_trip < self._max_quiet_s)
        if quiet:
            self.num_skipped += 1
        else:
            self._last_round_trip = time.monotonic()
        return quiet

    def _woken(self) -> bool:
        woken = False
        for _ in range(_MAX_DRAIN):
            try:
                self._socket.recv(16)
            except BlockingIOError:
                break
            woken = True
        return woken

    def close(self) -> None:
        self._socket.close()


def _all_wait_for_kv(scheduler: Any) -> bool:
    from vllm.v1.request import RequestStatus

    requests = getattr(scheduler, "requests", None)
    reported = getattr(scheduler, "finished_recving_kv_req_ids", None)
    failed = getattr(scheduler, "failed_recving_kv_req_ids", None)
    if not requests or reported is None or failed is None:
        return False
    if scheduler.running or scheduler.finished_req_ids or reported or failed:
        return False
    return all(request.status == RequestStatus.WAITING_FOR_REMOTE_KVS for request in requests.values())


def install_quiet_steps(engine_core_class: type | None = None) -> None:
    """Wraps `EngineCore.step` and `EngineCore.step_with_batch_queue` (async scheduling, the default
    on CUDA and NPU; idempotent; called in the engine core process before the engine binds its step
    function): a step the engine's PDMeshConnector says is quiet returns at once. With a batch queue
    it first collects the batches in flight, as vLLM does when it has nothing to schedule (else it
    would schedule a new empty batch, a worker round trip, on every step while requests wait for
    KV, and the queue would never empty). `engine_core_class`: vLLM's EngineCore unless given (tests)."""
    if engine_core_class is None:
        from vllm.v1.engine.core import EngineCore as engine_core_class

    if getattr(engine_core_class.step, "_pdmesh_quiet", False):
        return
    step_with_workers = engine_core_class.step
    step_with_batch_queue = engine_core_class.step_with_batch_queue

    def step(self):
        if _quiet(self):
            return {}, False
        return step_with_workers(self)

    def step_queued(self):
        if not _quiet(self):
            return step_with_batch_queue(self)
        if not self.batch_queue:
            return None, False
        return _collect_oldest_batch(self, step_with_batch_queue)

    step._pdmesh_quiet = step_queued._pdmesh_quiet = True
    engine_core_class.step = step
    engine_core_class.step_with_batch_queue = step_queued


def _collect_oldest_batch(engine_core: Any, step_with_batch_queue) -> tuple:
    """vLLM's own step with nothing to schedule: it waits for the oldest batch in flight and takes
    its outputs (the scheduler says it has no requests for this one call)."""
    scheduler = engine_core.scheduler
    scheduler.has_requests = _no_requests   # shadows the method on this instance for the call
    try:
        return step_with_batch_queue(engine_core)
    finally:
        del scheduler.has_requests


def _no_requests() -> bool:
    return False


def _quiet(engine_core: Any) -> bool:
    connector = engine_core.scheduler.get_kv_connector()
    quiet = getattr(connector, "quiet_step", None)
    return quiet is not None and quiet(engine_core.scheduler)

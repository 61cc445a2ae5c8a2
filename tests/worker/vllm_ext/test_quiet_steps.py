"""Which engine steps may skip the model workers: only those where every request waits for its KV,
nothing is due to the workers and no worker has said a transfer finished. The scheduler here is a
stand-in holding what the check reads; test_mesh_layerwise drives the real engine."""

import time
from collections import deque
from concurrent.futures import Future
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
from vllm.v1.engine.core import EngineCore
from vllm.v1.request import RequestStatus

from worker.vllm_ext.quiet_steps import QuietSteps, TransferWakeups, install_quiet_steps, new_wake_name

WAITING_FOR_KV = RequestStatus.WAITING_FOR_REMOTE_KVS


def _scheduler(*statuses, running=(), finished=(), reported=(), failed=()) -> SimpleNamespace:
    return SimpleNamespace(requests={f"r{i}": SimpleNamespace(status=s) for i, s in enumerate(statuses)},
                           running=list(running), finished_req_ids=set(finished),
                           finished_recving_kv_req_ids=set(reported), failed_recving_kv_req_ids=set(failed))


@pytest.fixture
def name() -> str:
    return new_wake_name()


@pytest.fixture
def quiet(name):
    steps = QuietSteps(name, max_quiet_s=30.0)
    yield steps
    steps.close()


@pytest.fixture
def wakeups(name, quiet):
    sender = TransferWakeups(name)
    yield sender
    sender.close()


def test_steps_skip_the_workers_while_every_request_waits_for_its_kv(quiet):
    scheduler = _scheduler(WAITING_FOR_KV, WAITING_FOR_KV)
    assert [quiet.skip(scheduler, connector_has_work=False) for _ in range(3)] == [True, True, True]
    assert quiet.num_skipped == 3


def test_a_worker_saying_a_transfer_finished_makes_the_next_step_go_to_the_workers(quiet, wakeups):
    scheduler = _scheduler(WAITING_FOR_KV)
    wakeups.transfer_finished()
    wakeups.transfer_finished()  # two workers (or two transfers) before the engine looked: one step
    assert [quiet.skip(scheduler, False) for _ in range(3)] == [False, True, True]
    assert quiet.num_skipped == 2


@pytest.mark.parametrize("scheduler, has_work", [
    (_scheduler(WAITING_FOR_KV, running=["r9"]), False),                  # a request computes
    (_scheduler(WAITING_FOR_KV, RequestStatus.WAITING), False),           # a new request, not yet scheduled
    (_scheduler(WAITING_FOR_KV, RequestStatus.FINISHED_ABORTED), False),  # finished, its blocks not yet freed
    (_scheduler(WAITING_FOR_KV, finished=["r1"]), False),                 # the workers must hear it finished
    (_scheduler(WAITING_FOR_KV, reported=["r0"]), False),                 # its KV landed: schedule it
    (_scheduler(WAITING_FOR_KV, failed=["r0"]), False),                   # its KV failed: recompute it
    (_scheduler(WAITING_FOR_KV), True),                                   # a transfer or release to start
    (_scheduler(), False),                                                # nothing held
    (SimpleNamespace(requests={"r0": SimpleNamespace(status=WAITING_FOR_KV)}, running=[],
                     finished_req_ids=set()), False),                     # a scheduler without what it reads
], ids=["running", "new", "finished-unfreed", "finished", "landed", "failed", "connector-work", "empty",
        "unknown-scheduler"])
def test_a_step_with_anything_to_do_goes_to_the_workers(quiet, scheduler, has_work):
    assert quiet.skip(scheduler, has_work) is False
    assert quiet.num_skipped == 0


def test_a_quiet_engine_still_goes_to_its_workers_every_max_quiet_s(name):
    quiet = QuietSteps(name, max_quiet_s=0.5)
    try:
        scheduler = _scheduler(WAITING_FOR_KV)
        assert quiet.skip(scheduler, False) is True
        time.sleep(0.6)
        assert [quiet.skip(scheduler, False), quiet.skip(scheduler, False)] == [False, True]
    finally:
        quiet.close()


def test_a_wakeup_before_the_engine_core_listens_is_dropped_without_error(name):
    sender = TransferWakeups(name)
    try:
        sender.transfer_finished()
    finally:
        sender.close()


def test_the_engine_step_returns_at_once_when_the_connector_says_it_is_quiet():
    install_quiet_steps()
    wrapped = EngineCore.step
    install_quiet_steps()
    assert EngineCore.step is wrapped  # installed once
    connector = SimpleNamespace(quiet_step=lambda scheduler: True)
    engine_core = SimpleNamespace(scheduler=SimpleNamespace(get_kv_connector=lambda: connector))
    assert EngineCore.step(engine_core) == ({}, False)


class _EngineCore:
    """vLLM's two step functions, recording that they ran (the connector decides in between)."""

    def __init__(self, quiet_step: bool, batches_in_flight: int = 0) -> None:
        connector = SimpleNamespace(quiet_step=lambda scheduler: quiet_step)
        self.scheduler = SimpleNamespace(get_kv_connector=lambda: connector)
        self.batch_queue = deque(range(batches_in_flight))
        self.steps: list[str] = []

    def step(self):
        self.steps.append("step")
        return {0: "outputs"}, True

    def step_with_batch_queue(self):
        self.steps.append("step_with_batch_queue")
        return {0: "outputs"}, True


@pytest.mark.parametrize("quiet_step, batches_in_flight, skipped", [
    (True, 0, True),    # nothing in flight, nothing to do: skip
    (True, 1, False),   # a batch's outputs are still to be collected
    (False, 0, False),  # the connector says step
])
def test_the_batch_queue_step_of_async_scheduling_skips_only_with_no_batch_in_flight(quiet_step, batches_in_flight,
                                                                                     skipped):
    """Async scheduling (CUDA's and NPU's default; vLLM's CPU platform turns it off, so this path
    runs on a device only) steps through step_with_batch_queue; the plain step is wrapped alike."""
    class EngineCore(_EngineCore):
        pass

    install_quiet_steps(EngineCore)
    install_quiet_steps(EngineCore)  # installed once
    engine_core = EngineCore(quiet_step, batches_in_flight)
    queued, plain = engine_core.step_with_batch_queue(), engine_core.step()
    if skipped:
        assert (queued, plain, engine_core.steps) == ((None, False), ({}, False), [])
    else:
        assert queued == ({0: "outputs"}, True) and engine_core.steps[0] == "step_with_batch_queue"


class _WaitingScheduler:
    """Requests that all wait for KV: each schedule is an empty batch."""

    def __init__(self, connector, collected: list) -> None:
        self._connector, self._collected = connector, collected

    def get_kv_connector(self):
        return self._connector

    def has_requests(self) -> bool:
        return True

    def schedule(self, throttle: bool):
        return SimpleNamespace(total_num_scheduled_tokens=0, pending_structured_output_tokens=False)

    def update_from_output(self, scheduler_output, model_output) -> dict:
        self._collected.append(model_output)
        return {}


class _AsyncEngineCore:
    """What vLLM's step_with_batch_queue reads, around a scheduler whose requests all wait for KV
    (each step schedules an empty batch) and an executor that answers at once."""

    def __init__(self, quiet_after: int) -> None:
        self.num_steps, self.quiet_after = 0, quiet_after
        connector = SimpleNamespace(quiet_step=lambda scheduler: self.num_steps > self.quiet_after)
        self.collected: list[int] = []
        self.scheduler = _WaitingScheduler(connector, self.collected)
        self.model_executor = SimpleNamespace(execute_model=self._execute)
        self.batch_queue_size, self.batch_queue = 2, deque(maxlen=2)
        self.is_mm_encoder_only = self.is_pooling_model = self.check_for_draft_tokens = False
        self.executed: list[int] = []

    def _execute(self, scheduler_output, non_block: bool):
        self.executed.append(len(self.executed))
        done = Future()
        done.set_result(self.executed[-1])
        return done

    def step(self):
        self.num_steps += 1
        return EngineCore.step_with_batch_queue(self)

    _should_throttle_prefills = staticmethod(lambda: False)
    _process_aborts_queue = staticmethod(lambda: None)
    _attach_iteration_details = _attach_weight_version = staticmethod(lambda *args: None)

    @contextmanager
    def log_error_detail(self, scheduler_output):
        yield

    @contextmanager
    def capture_iteration_details(self, scheduler_output):
        yield None


def test_async_scheduling_collects_the_batch_in_flight_then_stops_stepping_the_workers():
    """Under async scheduling vLLM keeps a batch in flight for as long as it has requests, and
    requests waiting for KV count: a quiet step collects that batch (its worker outputs say which
    transfers finished), then skips. Driven through vLLM's own step_with_batch_queue."""
    install_quiet_steps()
    engine_core = _AsyncEngineCore(quiet_after=1)   # step 1 takes the new request's receive task to the workers
    outputs = [engine_core.step() for _ in range(4)]
    assert engine_core.executed == [0] and engine_core.collected == [0]
    assert outputs == [(None, False), ({}, False), (None, False), (None, False)]
    assert not engine_core.batch_queue


def test_async_scheduling_without_quiet_steps_keeps_an_empty_batch_in_flight_every_step():
    """The control: vLLM's step as it is schedules a batch (a round trip to the workers) each step."""
    install_quiet_steps()
    engine_core = _AsyncEngineCore(quiet_after=100)
    for _ in range(4):
        engine_core.step()
    assert engine_core.executed == [0, 1, 2, 3] and len(engine_core.batch_queue) == 1

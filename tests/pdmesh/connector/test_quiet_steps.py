"""Which engine steps may skip the model workers: only those where every request waits for its KV,
nothing is due to the workers and no worker has said a transfer finished. The scheduler here is a
stand-in holding what the check reads; test_mesh_layerwise drives the real engine."""

import time
from collections import deque
from types import SimpleNamespace

import pytest
from vllm.v1.request import RequestStatus

from pdmesh.connector.quiet_steps import QuietSteps, TransferWakeups, install_quiet_steps, new_wake_name

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
    from vllm.v1.engine.core import EngineCore

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

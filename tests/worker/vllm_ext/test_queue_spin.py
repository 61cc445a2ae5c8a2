"""vLLM's shared-memory queue readers sleep at once with the spin set to 0, and spin as vLLM has
them otherwise (the control): a real MessageQueue, its reader waiting 0.4 s for a message, timed
by the reader thread's own CPU time. A wake-up the writer loses costs the sleeping reader a
bounded sleep, where vLLM's own reader sleeps until its 5 s recheck (the control)."""

import threading
import time

import pytest
from vllm.distributed.device_communicators.shm_broadcast import MessageQueue, SpinCondition

from worker.vllm_ext.queue_spin import MAX_SLEEP_MS, MIN_SLEEP_MS, set_queue_spin

WAIT_S = 0.4


@pytest.fixture
def restore_wait():
    vllm_wait = SpinCondition.wait
    yield
    SpinCondition.wait = vllm_wait


def _connected_pair() -> tuple[MessageQueue, MessageQueue]:
    writer = MessageQueue(1, 1, max_chunk_bytes=1 << 16, max_chunks=2)
    reader_box: dict = {}

    def connect() -> None:
        reader_box["queue"] = MessageQueue.create_from_handle(writer.export_handle(), 0)
        reader_box["queue"].wait_until_ready()

    connecting = threading.Thread(target=connect)
    connecting.start()
    writer.wait_until_ready()
    connecting.join(timeout=30)
    return writer, reader_box["queue"]


def _second_message_wait(writer: MessageQueue, reader: MessageQueue) -> tuple[float, float]:
    """(CPU seconds of the reader's thread, wall seconds) in a dequeue that waited WAIT_S for its message."""
    writer.enqueue("first")
    assert reader.dequeue(timeout=10) == "first"   # its last read: vLLM spins for busy_loop_s after it
    result: dict = {}

    def wait_for_second() -> None:
        started, started_cpu = time.monotonic(), time.thread_time()
        result["message"] = reader.dequeue(timeout=10)
        result["cpu_s"], result["wall_s"] = time.thread_time() - started_cpu, time.monotonic() - started

    waiting = threading.Thread(target=wait_for_second)
    waiting.start()
    time.sleep(WAIT_S)
    writer.enqueue("second")
    waiting.join(timeout=30)
    assert result["message"] == "second"
    return result["cpu_s"], result["wall_s"]


def _lose_wakeups(writer: MessageQueue) -> None:
    writer._spin_condition.notify = lambda: None   # as when its PUB socket drops one (SNDHWM 1)


def test_a_reader_with_no_spin_sleeps_until_its_message(restore_wait):
    set_queue_spin(0.0)
    cpu_s, _ = _second_message_wait(*_connected_pair())
    assert cpu_s < 0.1 * WAIT_S


def test_vllms_reader_spins_while_it_waits(restore_wait):
    cpu_s, _ = _second_message_wait(*_connected_pair())
    assert cpu_s > 0.5 * WAIT_S   # the control: what the setting takes away


def test_a_lost_wakeup_costs_a_sleeping_reader_at_most_its_longest_sleep(restore_wait):
    set_queue_spin(0.0)
    writer, reader = _connected_pair()
    _lose_wakeups(writer)
    _, wall_s = _second_message_wait(writer, reader)
    assert WAIT_S <= wall_s < WAIT_S + MAX_SLEEP_MS / 1000 + 0.1


def test_vllms_sleeping_reader_waits_out_a_lost_wakeup_until_its_recheck(restore_wait):
    """The control: vLLM's own wait, asked not to spin, with the same lost wake-up."""
    vllm_wait = SpinCondition.wait

    def no_spin(self, timeout_ms=None):
        self.busy_loop_s = 0
        return vllm_wait(self, timeout_ms)

    SpinCondition.wait = no_spin
    writer, reader = _connected_pair()
    _lose_wakeups(writer)
    _, wall_s = _second_message_wait(writer, reader)
    assert wall_s > 2.0   # its recheck: SHM_READER_RECHECK_INTERVAL_MS, 5 s


class _Condition:
    def __init__(self) -> None:
        self.busy_loop_s = 1.0
        self.last_read = 0.0
        self.seen: list[float] = []
        self.timeouts_ms: list[int | None] = []

    def wait(self, timeout_ms=None):
        self.seen.append(self.busy_loop_s)
        self.timeouts_ms.append(timeout_ms)


def _condition_class() -> type:
    """A class of its own per test: set_queue_spin replaces its wait."""
    return type("Condition", (_Condition,), {"wait": _Condition.wait})


def test_the_spin_is_set_on_readers_made_before_and_set_again_replaces_it():
    condition_class = _condition_class()
    condition = condition_class()
    set_queue_spin(0.0, condition_class)
    condition.wait(5)
    set_queue_spin(0.25, condition_class)   # wraps vLLM's wait, not the last wrapper
    condition.wait(5)
    assert condition.seen == [0.0, 0.25]
    assert condition_class.wait._pdmesh_vllm_wait is _Condition.wait


def test_sleeps_double_while_no_message_comes_and_start_again_after_one():
    condition_class = _condition_class()
    set_queue_spin(0.0, condition_class)
    condition = condition_class()
    for _ in range(9):
        condition.wait()
    condition.last_read = 1.0   # vLLM's reader read a message
    condition.wait(5000)
    condition.wait(1)           # a caller's shorter timeout (its deadline) stays
    assert condition.timeouts_ms == [1, 2, 4, 8, 16, 32, 64, 64, 64, MIN_SLEEP_MS, 1]


def test_none_leaves_vllms_spin():
    condition_class = _condition_class()
    set_queue_spin(None, condition_class)
    condition = condition_class()
    condition.wait()
    assert condition.seen == [1.0]

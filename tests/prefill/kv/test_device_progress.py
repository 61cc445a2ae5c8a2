"""The layer-wise producer's progress on an accelerator: a layer is reported once the device has
written it, in order, and the engine thread never waits.

The fake events below stand for the device reaching a point of the compute stream (the test says
when); the CUDA tests at the end run the same class with torch's events on a real stream, where a
device is present. On the CPU the reports go straight to LayerProgress (the e2e layer-wise tests)."""

import threading
import time

import pytest
import torch

from prefill.kv.device_progress import DeviceOrderedProgress, device_events, ordered_progress
from prefill.kv.held_transfers import HeldTransfers
from prefill.kv.layer_progress import LayerProgress
from worker.paged_kv import PagedKVCache

NUM_LAYERS = 4


class _FakeEvent:
    """A point of the compute stream; the device reaches it when the test calls complete()."""

    def __init__(self, recorded: list) -> None:
        self._reached = threading.Event()
        self._recorded = recorded

    def record(self) -> None:
        self._recorded.append(self)

    def synchronize(self) -> None:
        assert self._reached.wait(10), "the test never completed this event"

    def complete(self) -> None:
        self._reached.set()


@pytest.fixture
def progress() -> LayerProgress:
    return LayerProgress(NUM_LAYERS, HeldTransfers())


@pytest.fixture
def events() -> list[_FakeEvent]:
    return []


@pytest.fixture
def reports(progress, events):
    ordered = DeviceOrderedProgress(progress, lambda: _FakeEvent(events))
    yield ordered
    for event in events:
        event.complete()
    ordered.close()
    assert not ordered._thread.is_alive()


def _state(progress: LayerProgress, transfer_id: str = "t1") -> tuple[int, int, int]:
    answer = progress.watch(transfer_id, 0, wait_s=0)
    return answer.num_ready_tokens, answer.num_partial_tokens, answer.num_partial_layers


def _settled(reports: DeviceOrderedProgress, progress: LayerProgress, want: tuple[int, int, int]) -> tuple:
    """The state once the reports thread has applied what it can (it is given up to 5 s)."""
    deadline = time.monotonic() + 5
    while _state(progress) != want and time.monotonic() < deadline:
        time.sleep(0.005)
    return _state(progress)


def test_a_layer_is_reported_only_once_the_device_has_written_it_and_in_order(reports, progress, events):
    reports.start_step("t1", "r1", [7, 8], num_tokens_before=0, num_tokens_after=40)
    reports.layer_done(0)
    reports.layer_done(1)  # the engine thread goes on while the device has not reached layer 0
    assert len(events) == 2
    assert _settled(reports, progress, (0, 40, 0)) == (0, 40, 0)
    time.sleep(0.05)
    assert _state(progress) == (0, 40, 0)  # launched, not written: nothing to read yet
    events[1].complete()  # events complete in stream order; the reports wait for the first anyway
    time.sleep(0.05)
    assert _state(progress) == (0, 40, 0)
    events[0].complete()
    assert _settled(reports, progress, (0, 40, 2)) == (0, 40, 2)


def test_the_next_step_starts_only_after_the_device_finished_the_previous_one(reports, progress, events):
    reports.start_step("t1", "r1", [7, 8], 0, 40)
    for layer in range(NUM_LAYERS):
        reports.layer_done(layer)
    reports.step_done()
    reports.start_step("t1", "r1", [7, 8, 9], 40, 70)  # the next chunk, launched before the device is done
    reports.layer_done(0)
    for event in events[:NUM_LAYERS - 1]:
        event.complete()
    assert _settled(reports, progress, (0, 40, 3)) == (0, 40, 3)
    events[NUM_LAYERS - 1].complete()
    time.sleep(0.05)
    assert _state(progress) == (0, 40, NUM_LAYERS)  # every layer launched, the step's end not reached
    events[NUM_LAYERS].complete()  # the step's end: its tokens are ready, then the next chunk starts
    assert _settled(reports, progress, (40, 70, 0)) == (40, 70, 0)
    events[NUM_LAYERS + 1].complete()
    assert _settled(reports, progress, (40, 70, 1)) == (40, 70, 1)


def test_a_step_without_layerwise_transfers_records_no_event(reports, progress, events):
    for layer in range(NUM_LAYERS):
        reports.layer_done(layer)
    reports.step_done()
    reports.start_step("t1", "r1", [7], 0, 10)
    reports.held("t1")  # done before this step's layers: they are not the transfer's
    reports.layer_done(0)
    reports.step_done()
    assert events == []


def test_the_reports_thread_stops_on_close(progress, events):
    ordered = DeviceOrderedProgress(progress, lambda: _FakeEvent(events))
    ordered.close()
    assert not ordered._thread.is_alive()


def test_on_the_cpu_the_engine_thread_reports_straight_to_the_progress(progress):
    assert device_events("cpu") is None
    assert ordered_progress(progress, "cpu") is progress


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
def test_on_cuda_a_layer_is_reported_once_the_stream_has_run_its_kernels(progress):
    reports = DeviceOrderedProgress(progress, device_events("cuda:0"))
    try:
        reports.start_step("t1", "r1", [7], 0, 16)
        torch.cuda._sleep(2_000_000_000)  # the layer's kernels, still running for about a second
        reports.layer_done(0)
        time.sleep(0.1)
        assert _state(progress) == (0, 16, 0)
        torch.cuda.synchronize()
        assert _settled(reports, progress, (0, 16, 1)) == (0, 16, 1)
    finally:
        reports.close()


@cuda
def test_on_cuda_a_read_does_not_wait_for_the_compute_stream():
    cache = torch.arange(8 * 64, dtype=torch.float16, device="cuda:0").view(8, 64)
    paged = PagedKVCache({"layer.0": cache}, num_blocks=8)
    want = cache[3].cpu().view(torch.uint8)
    torch.cuda._sleep(2_000_000_000)  # the compute stream is busy with the step's later layers
    rows = paged.read_blocks([3])
    assert not torch.cuda.current_stream().query()  # read and back while the compute stream still runs
    assert torch.equal(rows[0], want)
    torch.cuda.synchronize()


def test_a_report_that_fails_does_not_stop_the_ones_after_it(progress, events, caplog):
    reports = DeviceOrderedProgress(progress, lambda: _FakeEvent(events))
    try:
        reports.start_step("t1", "r1", [7], 0, 16)
        reports._queue.put((None, progress.restart, ()))  # a report whose call fails (no transfer id)
        reports.layer_done(0)
        events[0].complete()
        assert _settled(reports, progress, (0, 16, 1)) == (0, 16, 1)
        assert "restart failed" in caplog.text
    finally:
        reports.close()

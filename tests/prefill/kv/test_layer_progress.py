"""The producer's layer-by-layer progress of transfers still being prefilled, as Watch answers it."""

import threading
import time

import pytest

from pdmesh.errors import TransferNotFound
from prefill.kv.held_transfers import HeldTransfer, HeldTransfers
from prefill.kv.layer_progress import LayerProgress

NUM_LAYERS = 4


@pytest.fixture
def held() -> HeldTransfers:
    return HeldTransfers()


@pytest.fixture
def progress(held) -> LayerProgress:
    return LayerProgress(NUM_LAYERS, held)


def _fields(answer):
    return (answer.started, list(answer.block_ids), answer.num_ready_tokens, answer.num_partial_tokens,
            answer.num_partial_layers, answer.held, answer.restarts)


def test_a_step_reports_each_layer_then_every_layer_of_its_tokens(progress):
    progress.start_step("t1", "r1", [7, 8], num_tokens_before=0, num_tokens_after=40)
    first = progress.watch("t1", 0, wait_s=0)
    assert _fields(first) == (True, [7, 8], 0, 40, 0, False, 0)
    progress.layer_done(0)
    progress.layer_done(1)
    second = progress.watch("t1", first.version, wait_s=0)
    assert second.version > first.version and _fields(second) == (True, [7, 8], 0, 40, 2, False, 0)
    progress.step_done()
    assert _fields(progress.watch("t1", second.version, wait_s=0)) == (True, [7, 8], 40, 40, NUM_LAYERS, False, 0)
    progress.start_step("t1", "r1", [7, 8, 9], num_tokens_before=40, num_tokens_after=70)  # the next chunk
    assert _fields(progress.watch("t1", 0, wait_s=0)) == (True, [7, 8, 9], 40, 70, 0, False, 0)


def test_a_steps_start_is_not_announced(progress):
    """Nothing is new to read when a step starts (each answer is a round trip on the producer's
    cores): the step's first written layer is the next answer, with the step's blocks."""
    progress.start_step("t1", "r1", [7], 0, 20)
    progress.step_done()
    seen = progress.watch("t1", 0, wait_s=0).version
    threading.Timer(0.05, progress.start_step, args=("t1", "r1", [7, 8], 20, 40)).start()
    started = time.monotonic()
    assert progress.watch("t1", seen, wait_s=0.3).version == seen  # a watcher sleeps through it
    assert time.monotonic() - started >= 0.29
    progress.layer_done(0)
    answer = progress.watch("t1", seen, wait_s=0)
    assert answer.version > seen and (list(answer.block_ids), answer.num_partial_layers) == ([7, 8], 1)


def test_layers_of_a_step_without_layerwise_transfers_change_nothing(progress):
    progress.layer_done(3)
    progress.step_done()
    assert progress.watch("t1", 0, wait_s=0).version == 0  # unknown: not scheduled yet


def test_a_watch_waits_for_the_next_layer_and_wakes_on_it(progress):
    progress.start_step("t1", "r1", [7], 0, 20)
    seen = progress.watch("t1", 0, wait_s=0).version
    threading.Timer(0.1, progress.layer_done, args=(0,)).start()
    started = time.monotonic()
    answer = progress.watch("t1", seen, wait_s=5)
    assert answer.num_partial_layers == 1 and time.monotonic() - started < 2


def test_a_watch_without_progress_answers_what_it_has_after_its_wait(progress):
    progress.start_step("t1", "r1", [7], 0, 20)
    seen = progress.watch("t1", 0, wait_s=0).version
    started = time.monotonic()
    assert progress.watch("t1", seen, wait_s=0.2).version == seen
    assert time.monotonic() - started >= 0.19


def test_once_held_the_answer_is_the_held_transfers_blocks(progress, held):
    progress.start_step("t1", "r1", [7, 8], 0, 40)
    progress.step_done()
    held.hold(HeldTransfer("t1", (7, 8), (b"a", b"b"), deadline=1e18))
    progress.held("t1")
    answer = progress.watch("t1", 0, wait_s=0)
    assert (answer.held, list(answer.block_ids)) == (True, [7, 8])
    assert progress.num_prefilling == 0
    held.release("t1")
    with pytest.raises(TransferNotFound):  # released: nothing to read any more
        progress.watch("t1", 0, wait_s=0)


def test_an_ended_transfer_is_not_found_and_its_watchers_wake(progress):
    progress.start_step("t1", "r1", [7], 0, 20)
    threading.Timer(0.1, progress.end_request, args=("r1",)).start()
    with pytest.raises(TransferNotFound):
        progress.watch("t1", 10**6, wait_s=5)
    progress.start_step("t1", "r1", [7], 0, 20)  # a late step of an ended transfer is ignored
    with pytest.raises(TransferNotFound):
        progress.watch("t1", 0, wait_s=0)


def test_a_preempted_request_restarts_from_no_blocks(progress):
    progress.start_step("t1", "r1", [7, 8], 0, 40)
    progress.step_done()
    progress.restart("t1")
    assert _fields(progress.watch("t1", 0, wait_s=0)) == (True, [], 0, 0, 0, False, 1)
    progress.layer_done(2)  # it is no longer in the running step
    assert progress.watch("t1", 0, wait_s=0).num_partial_layers == 0


def test_a_written_prompt_is_final_before_it_is_held(progress):
    progress.start_step("t1", "r1", [7, 8], 0, 40)
    progress.step_done()
    seen = progress.watch("t1", 0, wait_s=0).version
    written = HeldTransfer("t1", (7, 8), (b"a", b"b"), deadline=float("inf"))
    threading.Timer(0.05, progress.written, args=("t1", written, 0)).start()
    answer = progress.watch("t1", seen, wait_s=5)  # the watcher wakes on it
    assert (answer.held, list(answer.block_ids)) == (True, [7, 8])
    assert progress.written_transfer("t1") is written


@pytest.mark.parametrize("since", ["preempted", "ended"])
def test_what_was_computed_before_a_preemption_or_an_end_is_not_published(progress, since):
    progress.start_step("t1", "r1", [7, 8], 0, 40)
    progress.step_done()
    restarts = progress.restarts("t1")
    progress.restart("t1") if since == "preempted" else progress.end("t1")
    progress.written("t1", HeldTransfer("t1", (7, 8), (b"a", b"b"), deadline=float("inf")), restarts)
    assert progress.written_transfer("t1") is None
    if since == "preempted":
        assert progress.watch("t1", 0, wait_s=0).held is False
    assert progress.restarts("t1") == (1 if since == "preempted" else -1)


@pytest.mark.parametrize("num_step_tokens, announced_after", [
    (40, [1, 2, 3, 4]),   # 40 KiB a layer: each layer is worth a read
    (20, [2, 4]),         # 20 KiB: two layers to an answer
    (8, []),              # 8 KiB: only the step's end (4 layers hold 32 KiB)
])
def test_written_layers_are_announced_once_they_hold_min_read_bytes(held, num_step_tokens, announced_after):
    """A Watch answer is a round trip on the producer's cores while it computes: layers too small
    to be worth reading early are announced together, or with the step's end."""
    progress = LayerProgress(NUM_LAYERS, held, layer_bytes_per_token=1024, min_read_bytes=40 << 10)
    progress.start_step("t1", "r1", [7, 8], num_tokens_before=100, num_tokens_after=100 + num_step_tokens)
    seen = progress.watch("t1", 0, wait_s=0).version
    announced = []
    for layer in range(NUM_LAYERS):
        progress.layer_done(layer)
        answer = progress.watch("t1", seen, wait_s=0)
        if answer.version > seen:
            seen = answer.version
            announced.append(answer.num_partial_layers)
    assert announced == announced_after
    progress.step_done()
    assert progress.watch("t1", seen, wait_s=0).num_ready_tokens == 100 + num_step_tokens

import threading
import time

import pytest

from pdmesh.errors import TransferNotFound
from prefill.kv.held_transfers import HeldTransfer, HeldTransfers


def _held(transfer_id: str, deadline: float = 1e18) -> HeldTransfer:
    return HeldTransfer(transfer_id, (4, 5), (b"a", b"b"), deadline)


def test_release_finishes_a_transfer_once():
    held = HeldTransfers()
    held.hold(_held("t1"))
    assert held.num_held == 1
    assert held.release("t1") is True
    assert held.release("t1") is False
    assert held.take_finished() == {"t1"}
    assert held.take_finished() == set()
    assert held.num_held == 0


def test_a_release_that_arrives_before_the_hold_frees_it_on_arrival():
    held = HeldTransfers()
    assert held.release("early") is False
    held.hold(_held("early"))
    assert held.num_held == 0
    assert held.take_finished() == {"early"}


def test_early_releases_are_forgotten_after_their_ttl():
    held = HeldTransfers(early_release_ttl_s=10.0)
    held.release("never-held")
    held.take_finished(now=1e12)  # far past the ttl
    held.hold(_held("never-held"))
    assert held.num_held == 1


def test_transfers_past_their_deadline_are_freed_and_counted():
    held = HeldTransfers()
    held.hold(_held("old", deadline=10.0))
    held.hold(_held("new", deadline=20.0))
    assert held.take_finished(now=15.0) == {"old"}
    assert held.num_expired == 1
    assert held.num_held == 1
    with pytest.raises(TransferNotFound):
        held.wait_for("old", timeout_s=0.01)


def test_wait_for_sees_an_announced_transfer_registered_later():
    held = HeldTransfers()
    held.announce(["late"])   # minted when its request was scheduled: the hold lags the handle by a step
    timer = threading.Timer(0.05, held.hold, args=(_held("late"),))
    timer.start()
    assert held.wait_for("late", timeout_s=5).block_ids == (4, 5)
    timer.join()


def test_wait_for_a_transfer_never_announced_fails_at_once():
    """A made-up id (a guess, a peer probing the port) holds no KV-port thread while it waits."""
    held = HeldTransfers()
    held.announce(["other"])
    started = time.monotonic()
    with pytest.raises(TransferNotFound, match="no KV held for transfer 'nope', and none announced"):
        held.wait_for("nope", timeout_s=30)
    assert time.monotonic() - started < 0.5


def test_an_announced_transfer_whose_request_ended_unheld_fails_a_waiting_read_at_once():
    held = HeldTransfers()
    held.announce(["t1"])
    timer = threading.Timer(0.05, held.drop_announced, args=(["t1"],))
    timer.start()
    started = time.monotonic()
    with pytest.raises(TransferNotFound, match="transfer 't1' was abandoned before this read"):
        held.wait_for("t1", timeout_s=30)
    assert time.monotonic() - started < 5
    timer.join()


def test_announcements_are_forgotten_at_the_hold_or_after_their_ttl():
    held = HeldTransfers(announced_ttl_s=10.0)
    held.announce(["held", "forgotten"], now=0.0)
    held.hold(_held("held"))
    held.take_finished(now=11.0)
    with pytest.raises(TransferNotFound, match="none announced"):
        held.wait_for("forgotten", timeout_s=30)
    assert held.wait_for("held", timeout_s=0).block_ids == (4, 5)


def test_a_cancelled_request_frees_its_held_transfer():
    held = HeldTransfers()
    held.hold(HeldTransfer("engine-id-1", (1, 2), (b"a", b"b"), deadline=1e18, request_id="r1"))
    held.hold(HeldTransfer("engine-id-2", (3,), (b"c",), deadline=1e18, request_id="r2"))
    assert held.release_request("r1") == 1
    assert (held.take_finished(), held.num_held) == ({"engine-id-1"}, 1)


def test_a_cancel_before_the_engine_registers_the_hold_frees_it_on_arrival():
    held = HeldTransfers(early_release_ttl_s=60)
    assert held.release_request("r1") == 0
    held.hold(HeldTransfer("engine-id-1", (1,), (b"a",), deadline=1e18, request_id="r1"))
    assert (held.take_finished(), held.num_held) == ({"engine-id-1"}, 0)
    held.hold(HeldTransfer("engine-id-9", (2,), (b"b",), deadline=1e18, request_id="r1-retry1"))
    assert held.num_held == 1   # another attempt's id is not cancelled


# A consumer late past the hold's end must learn at once that the blocks are gone: waiting out the
# registration wait (seconds) per late read is how one slow moment snowballed into a stalled decode.
@pytest.mark.parametrize("end, how", [
    (lambda held: held.release("t1"), "released"),
    (lambda held: held.release_request("r1"), "cancelled"),
    (lambda held: held.take_finished(now=1e17), "expired"),   # past its deadline
], ids=["released", "cancelled", "expired"])
def test_a_read_of_a_transfer_that_ended_fails_at_once_saying_how(end, how):
    held = HeldTransfers()
    held.hold(HeldTransfer("t1", (4,), (b"a",), deadline=1e16, request_id="r1"))
    end(held)
    started = time.monotonic()
    with pytest.raises(TransferNotFound, match=f"transfer 't1' was {how} before this read"):
        held.wait_for("t1", timeout_s=30)
    assert time.monotonic() - started < 5


def test_a_read_waiting_for_the_hold_ends_when_an_early_release_cancels_it():
    held = HeldTransfers()
    held.announce(["t1"])
    held.release("t1")   # the consumer gave up before the engine registered the hold
    timer = threading.Timer(0.05, held.hold, args=(_held("t1"),))
    timer.start()
    with pytest.raises(TransferNotFound, match="was released"):
        held.wait_for("t1", timeout_s=30)
    timer.join()


def test_ended_transfers_are_forgotten_after_the_ttl():
    held = HeldTransfers(early_release_ttl_s=10.0)
    held.hold(_held("t1"))
    held.release("t1")
    held.take_finished(now=1e12)   # far past the ttl
    with pytest.raises(TransferNotFound, match="no KV held"):
        held.wait_for("t1", timeout_s=0.01)

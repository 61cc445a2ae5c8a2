import pytest

from pdmesh.errors import InvalidRequest
from prefill.used_transfer_ids import UsedTransferIds


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_transfer_id_is_refused_the_second_time_while_remembered():
    clock = Clock()
    used = UsedTransferIds(remember_s=10.0, clock=clock)
    used.claim("a" * 24)
    clock.now += 9.9
    with pytest.raises(InvalidRequest, match="already used"):
        used.claim("a" * 24)
    used.claim("b" * 24)
    assert len(used) == 2


def test_ids_are_forgotten_oldest_first_once_past_their_time():
    clock = Clock()
    used = UsedTransferIds(remember_s=10.0, clock=clock)
    used.claim("a" * 24)
    clock.now += 5
    used.claim("b" * 24)
    clock.now += 5   # a's time is up, b's is not
    used.claim("c" * 24)
    assert len(used) == 2
    used.claim("a" * 24)
    with pytest.raises(InvalidRequest):
        used.claim("b" * 24)


def test_no_transfer_id_is_nothing_to_claim():
    used = UsedTransferIds()
    used.claim("")
    used.claim("")
    assert len(used) == 0

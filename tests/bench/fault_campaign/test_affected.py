"""Which requests a trial counts as on its victim, what became of them, and the outage it caused
(bench/fault_campaign/affected.py), on made-up trials: exact counts and seconds."""

from __future__ import annotations

from dataclasses import replace

from bench.fault_campaign.affected import NO_OUTAGE, FaultWindow, Outage, longest_outage, on_victim, \
    requests_on_victim, tally_on_victim
from bench.fault_campaign.campaign import FaultResult, count_requests
from bench.fault_campaign.outcomes import Outcome, RequestResult

VICTIM = frozenset({"127.0.0.1:5001", "127.0.0.1:6001"})   # decode-0 as it bound its port, and its proxy
OTHER_PREFILL, OTHER_DECODE = "127.0.0.1:6002", "127.0.0.1:6003"
WINDOW = FaultWindow(at_s=10.0, over_s=20.0, addresses=VICTIM)


def _request(started_s: float, ended_s: float, outcome: Outcome = Outcome.COMPLETED, *, decode: str = OTHER_DECODE,
             prefill: str = OTHER_PREFILL, num_failovers: int = 0, remote_store_tokens: int = 0,
             request_id: str = "") -> RequestResult:
    routed = outcome == Outcome.COMPLETED   # only a completed request got the last message, with the route
    return RequestResult(0, started_s, ended_s, outcome, num_failovers=num_failovers, request_id=request_id,
                         prefill_worker=prefill if routed else "", decode_worker=decode if routed else "",
                         remote_store_tokens=remote_store_tokens)


ROUTED_THROUGH_VICTIM = _request(8, 12, decode="127.0.0.1:6001", request_id="routed")
RETRIED = _request(9, 15, num_failovers=1, request_id="retried")     # moved off the victim to OTHER_DECODE
FAILED = _request(11, 13, Outcome.FAILED_CLEAR, request_id="failed")
ELSEWHERE = _request(9, 14, request_id="elsewhere")                   # in flight, on the other workers
BEFORE = _request(2, 9.5, decode="127.0.0.1:6001", request_id="before")
AFTER = _request(21, 23, decode="127.0.0.1:6001", request_id="after")
ON_RESTARTED_VICTIM = _request(19, 22, decode="127.0.0.1:5001", request_id="restarted")
LOAD = [ROUTED_THROUGH_VICTIM, RETRIED, FAILED, ELSEWHERE, BEFORE, AFTER, ON_RESTARTED_VICTIM]


def test_the_requests_on_the_victim_are_those_routed_through_it_moved_off_it_or_failed_in_its_window():
    hit = requests_on_victim(LOAD, [WINDOW])
    assert [r.request_id for r in hit] == ["routed", "retried", "failed", "restarted"]
    assert tally_on_victim(hit) == {"completed": 2, "retried": 1, "failed_clear": 1, "failed_unclear": 0,
                                    "hung": 0, "wrong": 0}


def test_a_request_in_flight_on_other_workers_is_not_on_the_victim():
    assert not on_victim(ELSEWHERE, WINDOW)
    assert on_victim(ELSEWHERE, FaultWindow(10.0, 20.0, None))   # Redis: every request uses it
    assert not on_victim(ELSEWHERE, FaultWindow(10.0, 20.0, frozenset()))   # a victim no request is routed to


def test_a_read_of_the_victims_store_by_the_other_prefill_is_on_the_victim():
    fetched = _request(12, 16, remote_store_tokens=64)
    prefill_victim = FaultWindow(10.0, 20.0, frozenset({"127.0.0.1:6000"}), reads_victim_store=True)
    assert on_victim(fetched, prefill_victim)
    assert not on_victim(replace(fetched, remote_store_tokens=0), prefill_victim)
    assert not on_victim(fetched, replace(prefill_victim, reads_victim_store=False))   # a decode victim


def test_each_trial_counts_a_request_once_though_it_spans_two():
    second = FaultWindow(13.5, 14.5, VICTIM)   # RETRIED and ELSEWHERE span both windows
    assert [r.request_id for r in requests_on_victim(LOAD, [WINDOW, second])] == [
        "routed", "retried", "failed", "restarted"]


# An outage: completions at 1, 2, 7.5, 8 and 9; two requests fail between 2 and 7.5.
TIMELINE = [_request(0, 1), _request(0.5, 2), _request(1.5, 3, Outcome.FAILED_CLEAR), _request(1.75, 7.5),
            _request(2.5, 4, Outcome.HUNG), _request(7.25, 8), _request(8.25, 9)]


def test_the_outage_is_the_longest_stretch_with_requests_in_flight_and_none_completing():
    assert longest_outage(TIMELINE, FaultWindow(2.5, 6.0, VICTIM)) == Outage(5.5, 2.0, 2)
    # from 8, nothing in flight until 8.25: the stretch is 8.25 to 9 (the one before it, 7.5 to 8, is 0.5)
    assert longest_outage(TIMELINE, FaultWindow(7.75, 8.5, VICTIM)) == Outage(0.75, 8.25, 0)
    assert longest_outage(TIMELINE, FaultWindow(9.5, 12.0, VICTIM)) == NO_OUTAGE


def test_a_pause_with_nothing_in_flight_is_no_outage_and_failures_to_the_end_are_one():
    paused = [_request(0, 1), _request(5, 6.5)]   # nothing in flight from 1 to 5
    assert longest_outage(paused, FaultWindow(0.5, 5.5, VICTIM)) == Outage(1.5, 5.0, 0)
    failing_to_the_end = [_request(0, 2), _request(1, 4, Outcome.FAILED_CLEAR), _request(4, 10, Outcome.HUNG)]
    assert longest_outage(failing_to_the_end, FaultWindow(3.0, 3.5, VICTIM)) == Outage(8.0, 2.0, 2)


def test_a_row_counts_every_request_those_on_the_victims_and_each_trials_outage():
    row = FaultResult("sigkill_decode", "a fault")
    count_requests(row, LOAD, [WINDOW, FaultWindow(22.5, 22.75, frozenset({"127.0.0.1:9999"}))])
    assert (row.requests, row.requests_on_victim) == (7, 4)
    assert row.outcomes == {"completed": 6, "failed_clear": 1, "failed_unclear": 0, "hung": 0, "wrong": 0}
    assert row.on_victim == {"completed": 2, "retried": 1, "failed_clear": 1, "failed_unclear": 0, "hung": 0,
                             "wrong": 0}
    # completions at 9.5, 12, 14, 15, 22, 23: the first trial's longest stretch runs from 19 (nothing in
    # flight from 15 until ON_RESTARTED_VICTIM starts) to 22, the second's from 22 to 23
    assert (row.outages_s, row.failed_in_outages) == ([3.0, 1.0], 0)
    assert (row.longest_outage_s, row.median_outage_s) == (3.0, 2.0)

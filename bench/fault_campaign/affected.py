"""What a trial did to the load: the requests that were on its victim, what became of them, and the
outage it caused — the longest stretch with requests in flight and none completing.

A request was on the victim when it was in flight during the fault's window (from the injection
until the mesh was whole again, the victim restarted) and
- the gateway's route in its last message (`transfer.prefill_worker` / `decode_worker`) names one
  of the victim's addresses (the API port the gateway dials it on);
- or it read the victim's KV store from another prefill (`prefill_store_tokens["remote"]`, where
  the mesh has one other prefill: `FaultWindow.reads_victim_store`);
- or it failed over, or did not complete right: one fault at a time, a failover or failure in its
  window is the fault's doing (the failed attempt's route is not in the last message);
- or the victim is something every request uses (Redis: `FaultWindow.addresses` is None).
Requests merely in flight elsewhere are not counted: under a 16-stream load, most of them."""

from __future__ import annotations

import bisect
import enum
import itertools
import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from bench.fault_campaign.outcomes import Outcome, RequestResult


@dataclass(frozen=True)
class FaultWindow:
    at_s: float                         # time.monotonic() of the injection
    over_s: float                       # the mesh whole again (the victim restarted, continued...)
    addresses: frozenset[str] | None    # the victim's: API and KV ports, proxied and direct; None: every request's
    reads_victim_store: bool = False    # a remote store read by another prefill is a read of the victim's

    def overlaps(self, result: RequestResult) -> bool:
        return result.started_s <= self.over_s and result.ended_s >= self.at_s


class VictimOutcome(str, enum.Enum):
    COMPLETED = "completed"            # the monolithic tokens, first try
    RETRIED = "retried"                # the monolithic tokens after moving to another worker
    FAILED_CLEAR = "failed_clear"
    FAILED_UNCLEAR = "failed_unclear"
    HUNG = "hung"
    WRONG = "wrong"


@dataclass(frozen=True)
class Outage:
    seconds: float          # requests in flight, none completing (a failure does not end it)
    began_s: float          # time.monotonic()
    num_failed: int         # requests that ended without completing inside it


NO_OUTAGE = Outage(0.0, 0.0, 0)


def on_victim(result: RequestResult, window: FaultWindow) -> bool:
    if not window.overlaps(result):
        return False
    if window.addresses is None or result.num_failovers or result.outcome != Outcome.COMPLETED:
        return True
    if window.reads_victim_store and result.remote_store_tokens:
        return True
    return result.prefill_worker in window.addresses or result.decode_worker in window.addresses


def requests_on_victim(results: Iterable[RequestResult], windows: list[FaultWindow]) -> list[RequestResult]:
    """The requests on any trial's victim, each once."""
    return [r for r in results if any(on_victim(r, window) for window in windows)]


def victim_outcome(result: RequestResult) -> VictimOutcome:
    if result.outcome == Outcome.COMPLETED:
        return VictimOutcome.RETRIED if result.num_failovers else VictimOutcome.COMPLETED
    return VictimOutcome(result.outcome.value)


def tally_on_victim(results: Iterable[RequestResult]) -> dict[str, int]:
    counts = Counter(victim_outcome(result) for result in results)
    return {outcome.value: counts.get(outcome, 0) for outcome in VictimOutcome}


def longest_outage(results: list[RequestResult], window: FaultWindow) -> Outage:
    return Timeline(results).longest_outage(window)


class Timeline:
    """The load's requests ordered by their ends, to find each trial's outage in one pass."""

    def __init__(self, results: list[RequestResult]) -> None:
        by_end = sorted(results, key=lambda r: r.ended_s)
        self._ends = [r.ended_s for r in by_end]
        # the earliest start among the requests from the i-th end on: in flight from then
        self._earliest_start_from = list(itertools.accumulate(
            reversed([r.started_s for r in by_end]), min))[::-1] + [math.inf]
        self._failures = [r.ended_s for r in by_end if r.outcome != Outcome.COMPLETED]
        # a stretch runs from one bound to the next: the completions, and the last end if a failure
        self._bounds = [-math.inf, *(r.ended_s for r in by_end if r.outcome == Outcome.COMPLETED)]
        if self._ends and self._ends[-1] > self._bounds[-1]:
            self._bounds.append(self._ends[-1])

    def longest_outage(self, window: FaultWindow) -> Outage:
        """The longest stretch touching the window in which requests were in flight and none
        completed (with monolithic vLLM's tokens): from a completion, or the first start after it,
        to the next completion, or to the last request's end if none came. The load runs through
        the fault, so a mesh that serves nothing for a while shows it here."""
        longest = NO_OUTAGE
        first = max(0, bisect.bisect_left(self._bounds, window.at_s) - 1)
        for before, after in zip(self._bounds[first:], self._bounds[first + 1:]):
            if before > window.over_s:
                break
            begin = max(before, self._earliest_start_from[bisect.bisect_right(self._ends, before)])
            if begin >= after or begin > window.over_s or after - begin <= longest.seconds:
                continue
            num_failed = bisect.bisect_right(self._failures, after) - bisect.bisect_right(self._failures, begin)
            longest = Outage(after - begin, begin, num_failed)
        return longest

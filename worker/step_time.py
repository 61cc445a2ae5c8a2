"""How long this engine's decoding steps take: the TPOT every stream it decodes sees (a running
stream makes one token a step, and a prompt computed in that step delays them all), measured from
its own steps. The worker publishes it beside its prompt rate (worker/compute_rate.py), with every
finished request and in its registry record, so every gateway reads the same figure for a worker,
whichever gateway's streams it runs (gateway/placement.py).

A sample is the time from one step's start to the next's, taken when the later step decodes a
request that was already running (it made a token in the step before, or waited in it): an idle
engine's pause before a new request is never a sample, and a stall is, whatever stalled the batch.
The average spans some 20 steps (alpha 0.05): a stream's TPOT SLO is on its mean over its tokens, so
one long prompt's step moves the figure by a twentieth of its length, not to it.
"""

from __future__ import annotations

import time
from typing import Any

from pdmesh.ewma import Ewma


class DecodeStepTime:
    def __init__(self, max_gap_s: float = 2.0, alpha: float = 0.05) -> None:
        self._max_gap_s = max_gap_s
        self._average_s = Ewma(0.0, alpha)
        self._last_start: float | None = None

    @property
    def step_s(self) -> float:
        """The moving average of the decoding steps' time (0: none measured yet)."""
        return self._average_s.value

    @property
    def num_samples(self) -> int:
        return self._average_s.num_samples

    def on_step(self, num_decodes: int, now: float | None = None) -> None:
        """A step starts that decodes `num_decodes` requests already running."""
        now = time.perf_counter() if now is None else now
        gap_s = now - self._last_start if self._last_start is not None else 0.0
        if num_decodes > 0 and 0 < gap_s <= self._max_gap_s:
            self._average_s.observe(gap_s)
        self._last_start = now


def num_decodes(scheduler_output: Any) -> int:
    """Requests a vLLM step decodes: running ones (not first scheduled now) given one token."""
    scheduled = scheduler_output.num_scheduled_tokens
    return sum(1 for request_id in scheduler_output.scheduled_cached_reqs.req_ids if scheduled.get(request_id) == 1)

"""SLO attainment and goodput as DistServe defines them.

A request meets the SLOs when its TTFT and its TPOT (time per output token after the first) are
both within bounds; a request that failed meets none. A point's attainment is the share of the
requests it sent that met them. Goodput is the highest offered rate among the points whose
attainment reaches the goal (90%): 0 when none does. Never a maximum over points below the goal.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from bench.serving.workloads import ATTAINMENT_GOAL, Slo


@dataclass(frozen=True)
class Timing:
    ttft_ms: float
    tpot_ms: float       # 0 for a one-token answer
    max_itl_ms: float    # the longest gap between two of its tokens


def tpot_ms(latency_s: float, ttft_s: float, num_output_tokens: int) -> float:
    return 1e3 * (latency_s - ttft_s) / (num_output_tokens - 1) if num_output_tokens > 1 else 0.0


def meets(timing: Timing, slo: Slo) -> bool:
    return timing.ttft_ms <= slo.ttft_ms and timing.tpot_ms <= slo.tpot_ms


def attainment(timings: Sequence[Timing], num_sent: int, slo: Slo) -> float:
    """The share of the `num_sent` requests that completed within both SLOs."""
    return sum(meets(t, slo) for t in timings) / num_sent if num_sent else 0.0


def goodput(points: Sequence[tuple[float, float]], goal: float = ATTAINMENT_GOAL) -> float:
    """The highest offered rate (req/s) among (offered rate, attainment) points that reach `goal`."""
    return max((rate for rate, share in points if share >= goal), default=0.0)

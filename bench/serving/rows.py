"""One measured point of one arm: what the report is made of. Each row keeps every request's
timing (goodput under any SLO pair is computed from them later) and its stamp: the commit, machine
and time it ran on. Rows of other code or another machine are never merged into a report."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from bench.serving.goodput import Timing, attainment
from bench.serving.mesh_mix import remote_share
from bench.serving.workloads import SLOS
from bench.stamp import RunStamp


@dataclass
class Row:
    arm: str
    workload: str
    kind: str               # the workload's: closed, poisson, trace
    point: float            # concurrency, request rate or trace speed
    repeat: int             # 0, 1, 2: the same point run again on a freshly started arm
    offered_rate: float     # req/s sent (a closed loop: what it achieved)
    num_sent: int
    num_failed: int
    duration_s: float
    output_tokens: int
    timings: list[list[float]] = field(default_factory=list)   # [TTFT ms, TPOT ms, longest ITL ms] of each completed
    mix: dict[str, float] = field(default_factory=dict)   # a pdmesh arm's placements over the point (mesh_mix.py)
    code: str = ""          # RunStamp.code
    machine: str = ""
    run_at: str = ""

    @classmethod
    def measured(cls, stamp: RunStamp, timings: Sequence[Timing], **fields) -> "Row":
        return cls(**fields, timings=[[round(t.ttft_ms, 2), round(t.tpot_ms, 2), round(t.max_itl_ms, 2)]
                                      for t in timings], code=stamp.code, machine=stamp.machine, run_at=stamp.run_at)

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.duration_s if self.duration_s > 0 else 0.0

    def timing_list(self) -> list[Timing]:
        return [Timing(*t) for t in self.timings]

    def attainment(self) -> dict[str, float]:
        """Share of the requests sent within each SLO pair (workloads.SLOS)."""
        return {slo.name: attainment(self.timing_list(), self.num_sent, slo) for slo in SLOS}

    def percentile_ms(self, metric: int, q: int) -> float:
        """The q-th percentile of TTFT (metric 0), TPOT (1) or the longest ITL (2) of its requests."""
        values = sorted(t[metric] for t in self.timings)
        if not values:
            return float("nan")
        return values[min(len(values) - 1, int(q / 100 * len(values)))] if q < 100 else values[-1]

    def summary(self) -> str:
        mix = f", remote prompt tokens {remote_share(self.mix):.0%}, moved {self.mix.get('moved', 0):.0f}" \
            if self.mix else ""
        return (f"{self.output_tok_s:.0f} tok/s, TTFT p50 {self.percentile_ms(0, 50):.0f} ms, "
                f"TPOT p50 {self.percentile_ms(1, 50):.1f} ms, failed {self.num_failed}/{self.num_sent}, in SLO "
                + ", ".join(f"{name} {share:.0%}" for name, share in self.attainment().items()) + mix)


def to_json(rows: Sequence[Row]) -> list[dict]:
    return [asdict(row) for row in rows]


def from_json(items: Sequence[dict]) -> list[Row]:
    return [Row(**item) for item in items]


def foreign_rows(rows: Sequence[Row], stamp: RunStamp) -> list[Row]:
    """The rows run on other code or another machine than `stamp`'s."""
    return [row for row in rows if (row.code, row.machine) != (stamp.code, stamp.machine)]


def median_spread(values: Sequence[float]) -> tuple[float, float, float]:
    """(min, median, max)."""
    return min(values), statistics.median(values), max(values)

"""The serving report, from its rows alone: per workload, each arm's figure in every repeat, and the
candidate arm (the adaptive mesh) divided by the best other static arm of the same repeat (a ratio
always comes from one run), shown as its median and spread. A target is met only when the whole
spread clears it.

Figures: output tok/s per point on closed loops (the worst point's ratio is the workload's);
goodput (bench/serving/goodput.py) under each SLO pair on Poisson and trace workloads.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.serving.goodput import goodput
from bench.serving.mesh_mix import remote_share
from bench.serving.rows import Row, median_spread
from bench.serving.workloads import CLOSED, SLOS


@dataclass(frozen=True)
class Ratio:
    workload: str
    measure: str                     # "tok/s" or "goodput, <slo>"
    per_repeat: tuple[float, ...]    # candidate ÷ best other arm, one per repeat (nan: no arm served any)
    best_other: tuple[str, ...]      # which arm was best in each repeat

    def spread(self) -> tuple[float, float, float]:
        finite = [r for r in self.per_repeat if not math.isnan(r)]
        return median_spread(finite) if finite else (math.nan,) * 3

    def meets(self, target: float) -> bool:
        low = self.spread()[0]
        return not math.isnan(low) and low >= target


def figures(rows: Sequence[Row]) -> "Figures":
    """(workload, measure, arm, repeat) → the figure: per-point tok/s ("tok/s @ 16") or goodput."""
    found: dict[tuple[str, str, str, int], float] = {}
    by_run: dict[tuple[str, str, int], list[Row]] = defaultdict(list)
    for row in rows:
        by_run[(row.workload, row.arm, row.repeat)].append(row)
    for (workload, arm, repeat), points in by_run.items():
        if points[0].kind == CLOSED:
            for row in points:
                found[(workload, f"tok/s @ {row.point:g}", arm, repeat)] = row.output_tok_s
            continue
        attained = [(row.offered_rate, row.attainment()) for row in points]
        for slo in SLOS:
            scored = [(offered, shares[slo.name]) for offered, shares in attained]
            found[(workload, f"goodput, {slo.name}", arm, repeat)] = goodput(scored)
    return found


Figures = dict[tuple[str, str, str, int], float]


def ratios(found: Figures, candidate: str, others: Sequence[str]) -> list[Ratio]:
    """Candidate ÷ the best of `others` per (workload, measure), one per repeat, from figures(rows);
    on closed loops the worst point stands for the workload."""
    keys = sorted({(w, m) for (w, m, arm, _) in found if arm == candidate})
    repeats = sorted({r for (_, _, _, r) in found})
    result: dict[tuple[str, str], Ratio] = {}
    for workload, measure in keys:
        per_repeat, best = [], []
        for repeat in repeats:
            mine = found.get((workload, measure, candidate, repeat))
            theirs = {arm: found[(workload, measure, arm, repeat)] for arm in others
                      if (workload, measure, arm, repeat) in found}
            if mine is None or not theirs:
                continue
            best_arm = max(theirs, key=theirs.get)
            per_repeat.append(mine / theirs[best_arm] if theirs[best_arm] > 0 else (math.inf if mine > 0 else math.nan))
            best.append(best_arm)
        result[(workload, measure)] = Ratio(workload, measure, tuple(per_repeat), tuple(best))
    return _worst_point_per_closed_loop(list(result.values()))


def _worst_point_per_closed_loop(found: list[Ratio]) -> list[Ratio]:
    kept: dict[tuple[str, str], Ratio] = {}
    for ratio in found:
        key = (ratio.workload, "tok/s" if ratio.measure.startswith("tok/s") else ratio.measure)
        if key not in kept or ratio.spread()[1] < kept[key].spread()[1]:
            kept[key] = ratio
    return list(kept.values())


def table(found: Figures, arms: Sequence[str]) -> str:
    """Markdown: each (workload, measure) × arm as median [min–max] over the repeats, from figures(rows)."""
    keys = sorted({(w, m) for (w, m, _, _) in found})
    lines = ["| workload | measure | " + " | ".join(arms) + " |", "|---|---|" + "---|" * len(arms)]
    for workload, measure in keys:
        cells = []
        for arm in arms:
            values = [v for (w, m, a, _), v in found.items() if (w, m, a) == (workload, measure, arm)]
            cells.append(_spread_cell(values) if values else "–")
        lines.append(f"| {workload} | {measure} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def overhead_table(rows: Sequence[Row], candidate: str, baseline: str, rate: float, target: float) -> str:
    """Markdown: the candidate's TTFT p50 ÷ `baseline`'s at `rate` req/s, one ratio per repeat, per Poisson
    workload both ran at that rate: the mesh's own overhead with (almost) nothing queued. Empty when
    the baseline arm did not run."""
    ttft: dict[tuple[str, str, int], float] = {
        (row.workload, row.arm, row.repeat): row.percentile_ms(0, 50) for row in rows
        if row.kind != CLOSED and row.point == rate and row.arm in (candidate, baseline)}
    lines = []
    for workload in sorted({w for (w, _, _) in ttft}):
        per_repeat = [ttft[(w, candidate, r)] / ttft[(w, baseline, r)] for (w, arm, r) in sorted(ttft)
                      if (w, arm) == (workload, baseline) and (w, candidate, r) in ttft]
        if per_repeat:
            met = "met" if max(per_repeat) <= target else "not met"
            lines.append(f"| {workload} | {_spread_cell(per_repeat)} | {met} |")
    if not lines:
        return ""
    return "\n".join([f"| workload | {candidate} ÷ {baseline}, TTFT p50 at {rate:g} req/s: median [min–max] | "
                      f"≤ {target:g}× |", "|---|---|---|", *lines])


def mix_table(rows: Sequence[Row]) -> str:
    """Markdown: the pdmesh arms' P:D mix per point (bench/serving/mesh_mix.py), median [min–max] over repeats."""
    by_point: dict[tuple[str, str, float], list[Row]] = defaultdict(list)
    for row in rows:
        if row.mix:
            by_point[(row.workload, row.arm, row.point)].append(row)
    lines = ["| workload | point | arm | prompt tokens computed remotely | streams moved | placements by reason |",
             "|---|---|---|---|---|---|"]
    for (workload, arm, point), points in sorted(by_point.items()):
        reasons: dict[str, float] = defaultdict(float)
        for row in points:
            for key, value in row.mix.items():
                if key.startswith("reason:"):
                    reasons[key.removeprefix("reason:")] += value / len(points)
        shares = [100 * remote_share(row.mix) for row in points]
        moved = [row.mix.get("moved", 0.0) for row in points]
        lines.append(f"| {workload} | {point:g} | {arm} | {_spread_cell(shares)} % | {_spread_cell(moved)} | "
                     + ", ".join(f"{why} {n:.0f}" for why, n in sorted(reasons.items())) + " |")
    return "\n".join(lines)


def verdict_table(found: Sequence[Ratio], candidate: str, target: float) -> str:
    lines = [f"| workload | measure | {candidate} ÷ best other arm: median [min–max] | best other arm | "
             f"≥ {target:g}× |", "|---|---|---|---|---|"]
    for ratio in sorted(found, key=lambda r: (r.workload, r.measure)):
        low, mid, high = ratio.spread()
        cell = "no arm served it in SLO" if math.isnan(mid) else f"{mid:.2f} [{low:.2f}–{high:.2f}]"
        best = ", ".join(sorted(set(ratio.best_other))) or "–"
        lines.append(f"| {ratio.workload} | {ratio.measure} | {cell} | {best} | "
                     f"{'met' if ratio.meets(target) else 'not met'} |")
    return "\n".join(lines)


def plot_verdict(found: Sequence[Ratio], candidate: str, path: Path, target: float) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [r for r in sorted(found, key=lambda r: (r.workload, r.measure)) if not math.isnan(r.spread()[1])]
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(shown)), 4))
    lows, mids, highs = zip(*(r.spread() for r in shown)) if shown else ((), (), ())
    ax.bar(range(len(shown)), [min(m, 5.0) for m in mids], color="#4c72b0",
           yerr=[[m - lo for m, lo in zip(mids, lows)], [hi - m for m, hi in zip(mids, highs)]], capsize=4)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.axhline(target, color="#c44e52", linewidth=0.8, linestyle="--", label=f"target {target:g}×")
    ax.legend(loc="lower right", fontsize=7)
    ax.set_xticks(range(len(shown)), [f"{r.workload}\n{r.measure}" for r in shown], fontsize=7)
    ax.set_ylabel(f"{candidate} ÷ best other arm")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _spread_cell(values: Sequence[float]) -> str:
    low, mid, high = median_spread(values)
    return f"{mid:.3g} [{low:.3g}–{high:.3g}]" if len(values) > 1 else f"{mid:.3g}"

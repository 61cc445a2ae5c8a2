"""The serving benchmark: the adaptive mesh against monolithic vLLM, plain replicas and static
P/D splits, every arm in one invocation, on this machine's two cores.

python -m bench.serve [--profile full|mid|smoke] [--arms vllm,vllm-1core,replicas,...]
                      [--workloads short,long,...] [--repeats 3] [--candidate ARM] [--merge]

Arms: bench/serving/arms.py. Workloads, SLO pairs, seeds: bench/serving/workloads.py. Closed-loop and
Poisson points are loaded by vLLM's own tool, traces replayed on their timestamps
(bench/serving/replay.py). Every arm is started fresh for each repeat, in an order that turns
(bench/serving/run.py). Writes bench/report/serving_<profile>.{json,md} and the verdict chart
serving_<profile>_verdict.png: the candidate arm ÷ the best other static arm per workload, per
repeat, shown as median [min–max] (bench/serving/report.py). Every row records commit, machine and
time; --merge keeps an earlier report's rows of arms or workloads not run now, and refuses rows of
other code or another machine.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from dataclasses import asdict, replace
from pathlib import Path

from bench.common import REPORT_DIR
from bench.serving.arms import ARMS
from bench.serving.report import figures, mix_table, overhead_table, plot_verdict, ratios, table, verdict_table
from bench.serving.rows import Row, foreign_rows, from_json, to_json
from bench.serving.run import run
from bench.serving.workloads import MID, PROFILES, SLOS, Workload
from bench.stamp import RunStamp, run_stamp
from pdmesh.config import DEFAULT_MODEL_DIR

TARGET = 0.95   # the candidate's ratio to the best static arm the issue asks on every workload
# TTFT p50 at 1 req/s within 1.1× of a one-core monolithic engine's: the mesh's own overhead
OVERHEAD_BASELINE, OVERHEAD_RATE, OVERHEAD_TARGET = "vllm-1core", 1.0, 1.1


def model_dir_for(workloads: list[Workload]) -> Path:
    from pdmesh.models.tiny import ensure_llama, ensure_mid_llama

    models = {w.model for w in workloads}
    if len(models) != 1:
        raise SystemExit(f"one model per run: {sorted(models)}")
    return ensure_mid_llama(DEFAULT_MODEL_DIR.parent / "mid-llama") if models == {MID} else ensure_llama(
        DEFAULT_MODEL_DIR)


def kept_rows(earlier: list[Row], arms: list[str], workloads: list[str], stamp: RunStamp) -> list[Row]:
    """An earlier report's rows this run does not replace; SystemExit if any ran on other code or another machine."""
    kept = [row for row in earlier if row.arm not in arms or row.workload not in workloads]
    foreign = foreign_rows(kept, stamp)
    if foreign:
        raise SystemExit(f"the report has {len(foreign)} rows run on {foreign[0].code} / {foreign[0].machine}, "
                         f"this run is {stamp.code} / {stamp.machine}: ratios come from one run of one code "
                         "(run the profile again without --merge)")
    return kept


def write_report(path_base: Path, rows: list[Row], arms: list[str], candidate: str, profile: str) -> None:
    others = [name for name in arms if name != candidate and ARMS[name].static]
    per_arm = figures(rows)
    found = ratios(per_arm, candidate, others)
    chart = plot_verdict(found, candidate, path_base.with_name(path_base.name + "_verdict.png"), TARGET)
    stamps = sorted({(row.code, row.machine) for row in rows})
    lines = [f"# Serving, profile {profile} (python -m bench.serve; generated)", "",
             f"Run on {', '.join(f'{code} ({machine})' for code, machine in stamps)}; rows from "
             f"{min(r.run_at for r in rows)} to {max(r.run_at for r in rows)} UTC. SLO pairs: "
             + "; ".join(f"{s.name}: TTFT ≤ {s.ttft_ms:g} ms, TPOT ≤ {s.tpot_ms:g} ms" for s in SLOS) + ".", "",
             f"## {candidate} ÷ the best of {', '.join(others)} (per repeat; {chart.name})", "",
             verdict_table(found, candidate, TARGET), "", "## Every arm: median [min–max] over the repeats", "",
             table(per_arm, arms), "", "## pdmesh's placements per point (its gateway's counters)", "",
             mix_table(rows), ""]
    overhead = overhead_table(rows, candidate, OVERHEAD_BASELINE, OVERHEAD_RATE, OVERHEAD_TARGET)
    if overhead:
        lines += [f"## The mesh's own overhead: TTFT with little queued, against {OVERHEAD_BASELINE}", "",
                  overhead, ""]
    path_base.with_suffix(".md").write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", choices=sorted(PROFILES), default="full")
    parser.add_argument("--arms", default="vllm,vllm-1core,replicas,pdmesh-1p1d,pdmesh-adaptive")
    parser.add_argument("--candidate", default="pdmesh-adaptive", help="the arm divided by the best other static arm")
    parser.add_argument("--workloads", default="", help="comma-separated subset of the profile's workloads")
    parser.add_argument("--points", default="", help="comma-separated points to run instead of each workload's own "
                        "(an A/B at one rate; not the report's rows)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--merge", action="store_true", help="keep the earlier report's rows not run now")
    parser.add_argument("--out", default=str(REPORT_DIR))
    parser.add_argument("--point-timeout-s", type=float, default=1800.0)
    parser.add_argument("--report-only", action="store_true", help="run nothing: rewrite the report from the JSON")
    args = parser.parse_args(argv)
    workloads = [w for w in PROFILES[args.profile] if not args.workloads or w.name in args.workloads.split(",")]
    if args.points:
        workloads = [replace(w, points=tuple(float(p) for p in args.points.split(","))) for w in workloads]
    arms = args.arms.split(",")
    unknown = [name for name in arms if name not in ARMS]
    if unknown:
        raise SystemExit(f"unknown arms {unknown}; known: {sorted(ARMS)}")
    base = Path(args.out) / f"serving_{args.profile}"
    json_path = base.with_suffix(".json")
    wants_earlier = (args.merge or args.report_only) and json_path.exists()
    earlier = from_json(json.loads(json_path.read_text())["rows"]) if wants_earlier else []
    if args.report_only:
        write_report(base, earlier, sorted({r.arm for r in earlier}, key=lambda a: (a not in arms, a)), args.candidate,
                     args.profile)
        return
    stamp = run_stamp()
    kept = kept_rows(earlier, arms, [w.name for w in workloads], stamp) if args.merge else []

    def save(rows: list[Row]) -> None:
        """The rows so far, with the workloads and arms they hold (kept ones included)."""
        held = kept + rows
        workload_names, arm_names = {r.workload for r in held}, {r.arm for r in held} | set(arms)
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps({
            "profile": args.profile,
            "workloads": [asdict(w) for w in PROFILES[args.profile] if w.name in workload_names or w in workloads],
            "arms": {name: asdict(system) for name, system in ARMS.items() if name in arm_names},
            "rows": to_json(held)}, indent=1))

    with tempfile.TemporaryDirectory(prefix="pdmesh-serving-logs-") as log_dir:
        rows = run([ARMS[name] for name in arms], model_dir_for(workloads), workloads, args.repeats, stamp,
                   Path(log_dir), args.point_timeout_s, save)
    all_arms = list(dict.fromkeys([*arms, *(r.arm for r in kept)]))
    write_report(base, kept + rows, all_arms, args.candidate, args.profile)
    print(f"wrote {json_path} and {base.with_suffix('.md')}")


if __name__ == "__main__":
    main()

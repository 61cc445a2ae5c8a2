"""Fault campaign: a real mesh (Redis, 2 prefill workers with KV stores, 2 decode, a gateway) under
a 16-stream load, each fault injected `--trials` times; every request's outcome is checked against
monolithic vLLM's tokens (completed / failed with a clear status / failed unclearly / hung / wrong),
and afterwards no worker may hold a transfer, a pinned store block, a request or a KV block.

python -m bench.faults [--trials 100 --streams 16 --faults sigkill_decode restart_redis ...]

Writes bench/report/faults.{json,md,png} (bench/results/ with --scratch). The goal per fault:
100% completed or failed clearly, 0 unclear, 0 hung, 0 wrong, no leaks.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import tempfile
import time
from pathlib import Path

from bench.common import REPORT_DIR, RESULTS_DIR
from bench.fault_campaign.campaign import FaultResult, run_fault
from bench.fault_campaign.faults import Fault, all_faults
from bench.fault_campaign.load import Workload
from bench.fault_campaign.mesh import FaultMesh, MeshSpec, add_run_arguments, fresh_dir
from bench.fault_campaign.outcomes import Outcome
from bench.fault_campaign.workload import build_workload
from pdmesh.config import DEFAULT_MODEL_DIR
from pdmesh.models.tiny import ensure_llama


async def run_campaign(spec: MeshSpec, fault_names: list[str], trials: int, num_streams: int,
                       trials_by_fault: dict[str, int] | None = None) -> list[FaultResult]:
    faults = [fault for fault in all_faults() if fault.name in fault_names]
    workload = build_workload(spec.model_dir, fresh_dir(spec.run_dir / "reference"))
    with FaultMesh(spec) as mesh:
        return await run_faults(mesh, workload, faults, trials, num_streams, trials_by_fault)


async def run_faults(mesh: FaultMesh, workload: Workload, faults: list[Fault], trials: int, num_streams: int,
                     trials_by_fault: dict[str, int] | None = None) -> list[FaultResult]:
    """Each fault's row in turn; once a fault stopped (the mesh could not be made whole again), the
    faults after it are skipped, saying so, and the rows so far are kept."""
    results: list[FaultResult] = []
    stopped_by = ""   # the fault that left the mesh broken
    for fault in faults:
        if stopped_by:
            results.append(FaultResult(fault.name, fault.description, skipped=f"{stopped_by} stopped the mesh"))
            continue
        results.append(await run_fault(mesh, workload, fault, (trials_by_fault or {}).get(fault.name, trials),
                                       num_streams))
        stopped_by = fault.name if results[-1].stopped else ""
    return results


def markdown_table(results: list[FaultResult]) -> str:
    columns = [o.value for o in Outcome]
    lines = ["| fault | run (UTC) | trials (hit) | requests (in flight at a fault) | " + " | ".join(columns)
             + " | leaks | tenant B hits (probes) | goal |", "|---" * (len(columns) + 7) + "|"]
    for r in results:
        if r.skipped:
            lines.append(f"| {r.fault} | {r.run_at} | not run: {r.skipped} |" + " |" * (len(columns) + 4))
            continue
        counts = " | ".join(str(r.outcomes.get(c, 0)) for c in columns)
        lines.append(f"| {r.fault} | {r.run_at or '-'} | {r.trials} ({r.trials_hit}) | {r.requests} ({r.requests_hit}) | {counts} | "
                     f"{len(r.leaks)} | {_probes(r)} | {_goal(r)} |")
    return "\n".join(lines) + "\n"


def _goal(result: FaultResult) -> str:
    if result.stopped:
        return f"MISSED (stopped at {result.stopped})"
    return "met" if result.meets_goal else "MISSED"


def _probes(result: FaultResult) -> str:
    """Tenant B's hits of tenant A's KV among its judged probes ("-": a row run before the probe)."""
    return f"{result.cross_tenant_hits} ({result.probes_judged})" if result.probes_judged else "-"


def plot(results: list[FaultResult], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = [r for r in results if not r.skipped]
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(ran)), 4))
    bottoms = [0] * len(ran)
    for outcome, colour in zip(Outcome, ["#55a868", "#4c72b0", "#dd8452", "#8172b2", "#c44e52"]):
        shares = [100 * r.outcomes.get(outcome.value, 0) / max(1, r.requests) for r in ran]
        ax.bar([r.fault for r in ran], shares, bottom=bottoms, label=outcome.value, color=colour)
        bottoms = [b + s for b, s in zip(bottoms, shares)]
    ax.set_ylabel("% of requests")
    ax.set_title("Outcome of every request under each fault")
    ax.legend(fontsize=7, loc="lower left")
    plt.setp(ax.get_xticklabels(), rotation=30, ha="right", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_report(results: list[FaultResult], out_dir: Path, settings: dict) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "faults.json").write_text(json.dumps(
        {"settings": settings, "machine": platform.platform(), "faults": [r.as_json() for r in results]}, indent=2))
    (out_dir / "faults.md").write_text(markdown_table(results))
    plot(results, out_dir / "faults.png")


def main() -> None:
    names = [fault.name for fault in all_faults()]
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=100)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--faults", nargs="+", default=names, choices=names)
    parser.add_argument("--kv-transport", default="grpc", choices=["grpc", "shm", "mooncake"])
    add_run_arguments(parser)
    parser.add_argument("--merge", action="store_true",
                        help="keep the report's rows of the faults not run now (a campaign run in parts)")
    parser.add_argument("--add", action="store_true",
                        help="as --merge, and add this run's trials to the report's rows of the faults run now "
                             "(a fault's 100 trials run across sessions)")
    args = parser.parse_args()
    started = time.monotonic()
    out_dir = RESULTS_DIR if args.scratch else REPORT_DIR
    earlier = earlier_rows(out_dir / "faults.json", args.kv_transport) if args.merge or args.add else {}
    with tempfile.TemporaryDirectory(prefix="pdmesh-faults-") as run_dir:
        spec = MeshSpec(ensure_llama(DEFAULT_MODEL_DIR), Path(args.run_dir or run_dir), kv_transport=args.kv_transport)
        results = asyncio.run(run_campaign(spec, args.faults, args.trials, args.streams))
    ran = {r.fault: earlier[r.fault].plus(r) if args.add and r.fault in earlier else r for r in results}
    results = [ran.get(name) or earlier[name] for name in names if name in ran or name in earlier]
    settings = {**vars(args), "seconds": round(time.monotonic() - started)}
    write_report(results, out_dir, settings)
    print(markdown_table(results))


def earlier_rows(path: Path, kv_transport: str) -> dict[str, FaultResult]:
    """The rows of an earlier report of the same KV transport, by fault."""
    if not path.exists():
        return {}
    report = json.loads(path.read_text())
    if report["settings"]["kv_transport"] != kv_transport:
        raise SystemExit(f"{path} is a campaign over {report['settings']['kv_transport']}, not {kv_transport}")
    return {row["fault"]: FaultResult.from_json(row) for row in report["faults"]}


if __name__ == "__main__":
    main()

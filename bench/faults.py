"""Fault campaign: a real mesh (Redis, 2 prefill workers with KV stores, 2 decode, a gateway) under
a 16-stream load, each fault injected `--trials` times; every request's outcome is checked against
monolithic vLLM's tokens (completed / failed with a clear status / failed unclearly / hung / wrong),
and afterwards no worker may hold a transfer, a pinned store block, a request or a KV block.

The load runs through each trial, a killed worker's restart included. Per fault the row counts the
requests that were on the trial's victim (by the gateway's route; bench/fault_campaign/affected.py)
and what became of them (completed / retried on another worker / failed), and each trial's outage:
the longest stretch with requests in flight and none completing, and the requests that failed in it.

Each fault runs on the workers' default KV transport ("auto": shared memory on one host), but the
two that cut or flip KV chunks on a TCP proxy, which need KV over gRPC: one mesh per transport, in
turn. `--kv-transport` runs every fault on the one named instead (a proxy fault is then skipped
unless it is grpc).

Every row records the commit (and a hash of the tree's uncommitted diff), the machine and the time
it ran on. `--merge` / `--add` refuse an earlier report's rows run on other code than this tree's
(`--mixed-commits` keeps them beside this run's, each row showing its commit and the report saying
they differ); `--add` never sums a fault's trials across commits.

python -m bench.faults [--trials 100 --streams 16 --faults sigkill_decode restart_redis ...]

Writes bench/report/faults.{json,md,png} (bench/results/ with --scratch). The goal per fault:
100% completed or failed clearly, 0 unclear, 0 hung, 0 wrong, no leaks.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from bench.common import REPORT_DIR, RESULTS_DIR
from bench.fault_campaign.affected import VictimOutcome
from bench.fault_campaign.campaign import FaultResult, run_fault
from bench.fault_campaign.faults import Fault, all_faults
from bench.fault_campaign.load import Workload
from bench.fault_campaign.mesh import FaultMesh, MeshSpec, add_run_arguments, fresh_dir
from bench.fault_campaign.outcomes import Outcome
from bench.stamp import run_stamp
from bench.fault_campaign.workload import build_workload
from pdmesh.config import DEFAULT_MODEL_DIR
from pdmesh.models.tiny import ensure_llama

KV_TRANSPORTS = ["auto", "grpc", "shm", "mooncake"]


def transport_of(fault: Fault, forced: str | None) -> str:
    """The KV transport a fault runs on: the one the campaign was told, else the fault's own."""
    return forced or fault.kv_transport


async def run_campaign(spec: MeshSpec, fault_names: list[str], trials: int, num_streams: int,
                       trials_by_fault: dict[str, int] | None = None, kv_transport: str | None = None
                       ) -> list[FaultResult]:
    """The faults named, on one mesh per KV transport they run on (one after the other)."""
    faults = [fault for fault in all_faults() if fault.name in fault_names]
    workload = build_workload(spec.model_dir, fresh_dir(spec.run_dir / "reference"))
    by_transport: dict[str, list[Fault]] = {}
    for fault in faults:
        by_transport.setdefault(transport_of(fault, kv_transport), []).append(fault)
    results: list[FaultResult] = []
    for transport, group in by_transport.items():
        mesh_spec = replace(spec, kv_transport=transport, run_dir=fresh_dir(spec.run_dir / f"mesh-{transport}"))
        try:
            with FaultMesh(mesh_spec) as mesh:
                results += await run_faults(mesh, workload, group, trials, num_streams, trials_by_fault)
        except Exception as exc:   # a mesh that did not start (or failed past its rows): the rows before are kept
            reason = f"the mesh over {transport} failed: {type(exc).__name__}: {exc}"[:500]
            done = {r.fault for r in results}
            results += [skipped_row(f, reason, transport, num_streams) for f in group if f.name not in done]
    return results


async def run_faults(mesh: FaultMesh, workload: Workload, faults: list[Fault], trials: int, num_streams: int,
                     trials_by_fault: dict[str, int] | None = None) -> list[FaultResult]:
    """Each fault's row in turn; once a fault stopped (the mesh could not be made whole again), the
    faults after it are skipped, saying so, and the rows so far are kept."""
    results: list[FaultResult] = []
    stopped_by = ""   # the fault that left the mesh broken
    for fault in faults:
        if stopped_by:
            results.append(skipped_row(fault, f"{stopped_by} stopped the mesh", mesh.spec.kv_transport, num_streams))
            continue
        results.append(await run_fault(mesh, workload, fault, (trials_by_fault or {}).get(fault.name, trials),
                                       num_streams))
        stopped_by = fault.name if results[-1].stopped else ""
    return results


def skipped_row(fault: Fault, reason: str, kv_transport: str, num_streams: int) -> FaultResult:
    row = FaultResult(fault.name, fault.description, skipped=reason, kv_transport=kv_transport, streams=num_streams)
    row.record_stamp(run_stamp())
    return row


def markdown_table(results: list[FaultResult]) -> str:
    columns = [o.value for o in Outcome]
    lines = [code_note(results),
             "| fault | run (UTC) | commit | KV | trials (hit) | requests (on the victim) | " + " | ".join(columns)
             + " | on the victim: first try / retried / failed | outage s: longest / median (failed in it) | leaks"
             " | tenant B hits (probes) | goal |", "|---" * (len(columns) + 11) + "|"]
    for r in results:
        where = f"| {r.fault} | {r.run_at or '-'} | {r.code} | {r.kv_transport or '-'} |"
        if r.skipped:
            lines.append(f"{where} not run: {r.skipped} |" + " |" * (len(columns) + 6))
            continue
        counts = " | ".join(str(r.outcomes.get(c, 0)) for c in columns)
        lines.append(f"{where} {r.trials} ({r.trials_hit}) | {r.requests} ({r.requests_on_victim}) | {counts} | "
                     f"{_on_victim(r)} | {_outage(r)} | {len(r.leaks)} | {_probes(r)} | {_goal(r)} |")
    return "\n".join(line for line in lines if line) + "\n"


def code_note(results: list[FaultResult]) -> str:
    """"" when every row that ran did on the same code, else a line saying which rows ran on which."""
    faults_by_code: dict[str, list[str]] = {}
    for r in results:
        if not r.skipped:
            faults_by_code.setdefault(r.code, []).append(r.fault)
    if len(faults_by_code) < 2:
        return ""
    listed = "; ".join(f"{code}: {', '.join(faults)}" for code, faults in faults_by_code.items())
    return f"**Rows run on {len(faults_by_code)} different commits, not one campaign** ({listed}).\n"


def _on_victim(result: FaultResult) -> str:
    completed = result.on_victim.get(VictimOutcome.COMPLETED.value, 0)
    retried = result.on_victim.get(VictimOutcome.RETRIED.value, 0)
    return f"{completed} / {retried} / {result.requests_on_victim - completed - retried}"


def _outage(result: FaultResult) -> str:
    if not result.outages_s:
        return "-"
    return f"{result.longest_outage_s:.1f} / {result.median_outage_s:.1f} ({result.failed_in_outages})"


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
    commits = sorted({r.code for r in results if not r.skipped})
    (out_dir / "faults.json").write_text(json.dumps(
        {"settings": settings, "machine": platform.platform(), "commits": commits,
         "faults": [r.as_json() for r in results]}, indent=2))
    (out_dir / "faults.md").write_text(markdown_table(results))
    plot(results, out_dir / "faults.png")


def main() -> None:
    names = [fault.name for fault in all_faults()]
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=100)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--faults", nargs="+", default=names, choices=names)
    parser.add_argument("--kv-transport", default=None, choices=KV_TRANSPORTS,
                        help="every fault over this KV transport (default: auto, grpc for the KV proxy's faults)")
    add_run_arguments(parser)
    parser.add_argument("--merge", action="store_true",
                        help="keep the report's rows of the faults not run now (a campaign run in parts)")
    parser.add_argument("--add", action="store_true",
                        help="as --merge, and add this run's trials to the report's rows of the faults run now "
                             "(a fault's 100 trials run across sessions, on one commit)")
    parser.add_argument("--mixed-commits", action="store_true",
                        help="with --merge: keep rows run on other code than this tree's (flagged in the report)")
    args = parser.parse_args()
    started = time.monotonic()
    out_dir = RESULTS_DIR if args.scratch else REPORT_DIR
    earlier = earlier_rows(out_dir / "faults.json") if args.merge or args.add else {}
    transports = {f.name: transport_of(f, args.kv_transport) for f in all_faults() if f.name in args.faults}
    check_mergeable(earlier, run_stamp().code, transports, args.add, args.mixed_commits)
    with tempfile.TemporaryDirectory(prefix="pdmesh-faults-") as run_dir:
        spec = MeshSpec(ensure_llama(DEFAULT_MODEL_DIR), Path(args.run_dir or run_dir))
        results = asyncio.run(run_campaign(spec, args.faults, args.trials, args.streams,
                                           kv_transport=args.kv_transport))
    ran = {r.fault: _added_to_earlier(earlier.get(r.fault), r) if args.add else r for r in results}
    results = [ran.get(name) or earlier[name] for name in names if name in ran or name in earlier]
    settings = {**vars(args), "seconds": round(time.monotonic() - started)}
    write_report(results, out_dir, settings)
    print(markdown_table(results))


def earlier_rows(path: Path) -> dict[str, FaultResult]:
    """The rows of an earlier report, by fault (a row from before rows recorded their KV transport
    gets the report's)."""
    if not path.exists():
        return {}
    report = json.loads(path.read_text())
    transport = report["settings"].get("kv_transport") or ""
    return {row["fault"]: FaultResult.from_json({"kv_transport": transport, **row}) for row in report["faults"]}


def check_mergeable(earlier: dict[str, FaultResult], code: str, transports: dict[str, str], add: bool,
                    mixed_commits: bool) -> None:
    """Refuses, before anything runs, a report that would mix code: --add to a row run on other
    code or over another KV transport (a row is one commit's), or --merge beside rows run on other
    code than this tree's unless mixed_commits. transports: the faults to run, and theirs."""
    for fault, row in earlier.items():
        to_add = add and fault in transports and not row.skipped
        if to_add and (row.code, row.kv_transport) != (code, transports[fault]):
            raise SystemExit(f"--add: {fault}'s row ran on {row.code} over {row.kv_transport or '?'}; this run is "
                             f"{code} over {transports[fault]}: a row's trials all run on one commit and transport")
    kept = {fault: row.code for fault, row in earlier.items() if fault not in transports and not row.skipped}
    others = sorted({row_code for row_code in kept.values() if row_code != code})
    if others and not mixed_commits:
        raise SystemExit(f"the report's rows of {', '.join(f for f, c in kept.items() if c != code)} ran on "
                         f"{', '.join(others)}, not on this tree ({code}): rerun them, or pass --mixed-commits "
                         "to keep them beside this run's (the report flags it)")


def _added_to_earlier(earlier: FaultResult | None, later: FaultResult) -> FaultResult:
    """--add: the earlier row plus this run's; this run's alone (said on stderr) where the tree changed
    during the run, so the two no longer ran on one commit."""
    if earlier is None:
        return later
    try:
        return earlier.plus(later)
    except ValueError as exc:
        print(f"{later.fault}: not added to its earlier row ({exc}); the row is this run's alone", file=sys.stderr)
        return later


if __name__ == "__main__":
    main()

"""Fuzz profile for the report: the Hypothesis fuzz tests of the public APIs (gRPC Generate, the
OpenAI HTTP routes) and of the internal services (Prefill, Decode, KVTransfer, KVStore; the layer-wise
flow's Prefill and Decode) run against real vLLM workers with `--examples` examples a property
instead of CI's 60, seeded, and every answer counted by target and status.

python -m bench.fuzz [--examples 1000 --seed 2026] [--scratch]

Writes bench/report/fuzz.{json,md,png} (bench/results/ with --scratch). The goal: every answer is
tokens (HTTP 200) or a client-error status with a message (never UNKNOWN / INTERNAL / UNAVAILABLE /
5xx), the mesh serves monolithic vLLM's tokens after each test, and no worker holds a transfer, a
reservation or a request at the end: each is a test's assertion, so the goal is met when every test
passed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.common import REPORT_DIR, RESULTS_DIR
from tests.e2e.fuzz_tally import ANSWERED, EXAMPLES_ENV, TALLY_PATH_ENV

ROOT = Path(__file__).resolve().parent.parent
LAYERWISE = "tests/e2e/test_mesh_layerwise.py::test_fuzzed_layerwise_"
FUZZ_TESTS = ["tests/e2e/test_fuzz_public_apis.py", "tests/e2e/test_fuzz_internal_services.py",
              f"{LAYERWISE}prefill_requests_run_once_per_transfer_id_or_are_refused",
              f"{LAYERWISE}decode_requests_stream_or_are_refused"]
CLIENT_STATUSES = {"INVALID_ARGUMENT", "NOT_FOUND", "OUT_OF_RANGE", "FAILED_PRECONDITION", "RESOURCE_EXHAUSTED",
                   "UNAUTHENTICATED", "PERMISSION_DENIED"}


@dataclass
class FuzzTestResult:
    name: str
    outcome: str   # passed / failed / error / skipped
    seconds: float
    detail: str = ""


def is_client_error(outcome: str) -> bool:
    """A refusal the caller can act on: a client-class gRPC status or an HTTP 4xx."""
    if outcome.startswith("HTTP "):
        return 400 <= int(outcome.split()[1]) < 500
    return outcome in CLIENT_STATUSES


def run_fuzz_tests(examples: int, seed: int, work_dir: Path) -> tuple[dict, list[FuzzTestResult], int]:
    """The fuzz tests in one pytest session (their clusters as in CI): the tally, each test's outcome, rc."""
    tally_path, junit_path = work_dir / "tally.json", work_dir / "junit.xml"
    env = {**os.environ, EXAMPLES_ENV: str(examples), TALLY_PATH_ENV: str(tally_path)}
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", f"--hypothesis-seed={seed}",
               f"--junitxml={junit_path}", *FUZZ_TESTS]
    returncode = subprocess.run(command, cwd=ROOT, env=env, check=False).returncode
    tally = json.loads(tally_path.read_text()) if tally_path.exists() else {}
    return tally, junit_outcomes(junit_path) if junit_path.exists() else [], returncode


def junit_outcomes(junit_path: Path) -> list[FuzzTestResult]:
    outcomes = []
    for case in ElementTree.parse(junit_path).iter("testcase"):
        problem = next((child for child in case if child.tag in ("failure", "error", "skipped")), None)
        outcome = {None: "passed", "failure": "failed", "error": "error", "skipped": "skipped"}[
            None if problem is None else problem.tag]
        detail = "" if problem is None else (problem.get("message") or "")[:500]
        outcomes.append(FuzzTestResult(case.get("name", ""), outcome, float(case.get("time", 0)), detail))
    return outcomes


def target_rows(tally: dict) -> list[dict]:
    rows = []
    for target, counted in tally.items():
        outcomes: dict[str, int] = counted["outcomes"]
        client_errors, other = refusals_by_class(outcomes)
        rows.append({"target": target, "calls": sum(outcomes.values()), "answered": outcomes.get(ANSWERED, 0),
                     "client_errors": client_errors, "other": other,
                     "reasons": len(counted["messages"]), "messages": counted["messages"],
                     "cases": counted["cases"]})
    return rows


def refusals_by_class(outcomes: dict[str, int]) -> tuple[dict[str, int], dict[str, int]]:
    """The refusals among `outcomes`: (client errors, the others) by status."""
    refusals = {o: n for o, n in outcomes.items() if o != ANSWERED}
    return ({o: n for o, n in refusals.items() if is_client_error(o)},
            {o: n for o, n in refusals.items() if not is_client_error(o)})


def cases_table(rows: list[dict]) -> str:
    """How each way of building a call was answered, for the targets that build calls more ways than one."""
    lines = ["| target | case | calls | answered | client errors | other |", "|---|---|---|---|---|---|"]
    for row in rows:
        for case, outcomes in sorted(row["cases"].items()):
            client_errors, other = refusals_by_class(outcomes)
            lines.append(f"| {row['target']} | {case} | {sum(outcomes.values())} | {outcomes.get(ANSWERED, 0)} | "
                         f"{sum(client_errors.values())} | {sum(other.values())} |")
    return "\n".join(lines) + "\n"


def markdown_table(rows: list[dict]) -> str:
    lines = ["| target | calls | answered | client errors (by status) | reasons | other | ",
             "|---|---|---|---|---|---|"]
    for row in rows:
        statuses = ", ".join(f"{status} {n}" for status, n in sorted(row["client_errors"].items(),
                                                                       key=lambda item: -item[1]))
        other = ", ".join(f"{status} {n}" for status, n in row["other"].items()) or "0"
        lines.append(f"| {row['target']} | {row['calls']} | {row['answered']} | {statuses or '-'} | "
                     f"{row['reasons']} | {other} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 0.35 * len(rows) + 1.5))
    names = [row["target"] for row in rows]
    parts = [("answered", "#55a868", lambda row: row["answered"]),
             ("client error", "#4c72b0", lambda row: sum(row["client_errors"].values())),
             ("other (server error)", "#c44e52", lambda row: sum(row["other"].values()))]
    lefts = [0.0] * len(rows)
    for label, colour, count in parts:
        shares = [100 * count(row) / max(1, row["calls"]) for row in rows]
        ax.barh(names, shares, left=lefts, label=label, color=colour)
        lefts = [left + share for left, share in zip(lefts, shares)]
    for y, row in enumerate(rows):
        ax.text(101, y, f"{row['calls']}", va="center", fontsize=7)
    ax.set_xlim(0, 112)
    ax.invert_yaxis()
    ax.set_xlabel("% of fuzzed calls (number of calls at the right)")
    ax.set_title("Every fuzzed call's answer, by target", pad=24)
    ax.legend(fontsize=7, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=3, frameon=False)
    plt.setp(ax.get_yticklabels(), fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_report(rows: list[dict], tests: list[FuzzTestResult], returncode: int, settings: dict, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    goal_met = returncode == 0 and bool(tests) and all(t.outcome == "passed" for t in tests) \
        and not any(row["other"] for row in rows)
    (out_dir / "fuzz.json").write_text(json.dumps(
        {"settings": settings, "machine": platform.platform(), "goal_met": goal_met, "pytest_returncode": returncode,
         "tests": [asdict(t) for t in tests], "targets": rows}, indent=2))
    (out_dir / "fuzz.md").write_text(markdown_table(rows) + "\n" + cases_table(rows))
    plot(rows, out_dir / "fuzz.png")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--examples", type=int, default=1000, help="examples a property (CI: 60)")
    parser.add_argument("--seed", type=int, default=2026)
    parser.add_argument("--scratch", action="store_true", help="write to bench/results/, not the report")
    args = parser.parse_args()
    run_at = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="pdmesh-fuzz-") as work_dir:
        tally, tests, returncode = run_fuzz_tests(args.examples, args.seed, Path(work_dir))
    settings = {"examples": args.examples, "seed": args.seed, "run_at": run_at,
                "minutes": round((time.monotonic() - started) / 60, 1)}
    write_report(target_rows(tally), tests, returncode, settings, RESULTS_DIR if args.scratch else REPORT_DIR)
    sys.exit(returncode)


if __name__ == "__main__":
    main()

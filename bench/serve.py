"""Serving benchmark with vLLM's own load tool: monolithic vLLM vs pdmesh, side by side in one run.

python -m bench.serve [--profile quick|full] [--systems vllm,pdmesh,...] [--workloads short,long,...]

Each system is started fresh (bench/serve_systems.py), loaded with every workload point in turn by
`vllm.benchmarks.serve` (a process per point, bench/serve_client.py), then stopped. Writes
bench/report/serve.json (every point's metrics), bench/report/serve_*.png (latency and goodput vs
load per workload) and their tables (bench/report/serve_tables.md). Goodput is DistServe's: requests
per second meeting TTFT and TPOT SLOs (`--goodput`), and the highest offered rate at which >= 90% do.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.common import REPORT_DIR
from bench.serve_report import write_plots, write_report_tables
from bench.serve_systems import System, start
from pdmesh.config import DEFAULT_MODEL_DIR
from pdmesh.models.tiny import ensure_llama

SLO_TTFT_MS = 2500.0
SLO_TPOT_MS = 60.0
PERCENTILES = "50,90,99"


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    dataset_args: tuple[str, ...]
    num_prompts: int
    load: str                      # "rate": Poisson request rate; "concurrency": closed loop
    points: tuple[float, ...]


def _random(input_len: int, output_len: int, range_ratio: float = 0.0) -> tuple[str, ...]:
    return ("--dataset-name", "random", "--random-input-len", str(input_len), "--random-output-len", str(output_len),
            "--random-range-ratio", str(range_ratio))


SHARED_PREFIX = ("--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", "1536",
                 "--prefix-repetition-suffix-len", "256", "--prefix-repetition-num-prefixes", "4",
                 "--prefix-repetition-output-len", "64")

PROFILES: dict[str, list[Workload]] = {
    # The two figures of the serving issue: a quick check, a few minutes per system.
    "quick": [
        Workload("short", "random 512 in / 128 out, closed loop", _random(512, 128), 64, "concurrency", (16,)),
        Workload("long", "random 2,000 in / 64 out, Poisson", _random(2000, 64), 40, "rate", (3.0,)),
    ],
    "full": [
        Workload("short", "random 512 in / 128 out, closed loop", _random(512, 128), 48, "concurrency",
                 (4, 16, 32)),
        Workload("long", "random 2,000 in / 64 out, Poisson", _random(2000, 64), 32, "rate",
                 (0.5, 1.0, 2.0, 3.0, 4.0, 6.0)),
        Workload("mixed", "random 100-1,900 in / 13-243 out, Poisson", _random(1000, 128, 0.9), 48, "rate",
                 (1.0, 2.0, 4.0, 6.0, 8.0)),
        Workload("shared_prefix", "4 shared 1,536-token prefixes + 256 own tokens / 64 out, Poisson",
                 SHARED_PREFIX, 32, "rate", (1.0, 2.0, 4.0)),
    ],
}

# Run once on every system before it is measured (first-touch costs), with prompts no point uses.
WARMUP = Workload("warmup", "random 64 in / 8 out", _random(64, 8), 8, "concurrency", (4,))

SYSTEMS: dict[str, System] = {
    "vllm": System("vllm", "vllm", cores="0-1", description="monolithic vLLM, one engine on both cores"),
    "vllm-1core": System("vllm-1core", "vllm", cores="0", description="monolithic vLLM on core 0 only"),
    "vllm-disagg": System("vllm-disagg", "vllm-disagg", description="vLLM's own disaggregation: 1P (core 0) + "
                          "1D (core 1), ExampleConnector (KV through a shared directory), toy-proxy-style front"),
    "pdmesh": System("pdmesh", "pdmesh", description="pdmesh 1P (core 0) + 1D (core 1), defaults (KV store on)"),
    "pdmesh-nostore": System("pdmesh-nostore", "pdmesh", worker_args=("--no-store.enabled",),
                             description="pdmesh 1P + 1D, KV store off"),
    "pdmesh-noquiet": System("pdmesh-noquiet", "pdmesh", worker_args=("--no-kv_quiet_steps",),
                             description="pdmesh 1P + 1D, engines step their workers while requests wait for KV "
                                         "(vLLM's way; before kv_quiet_steps)"),
    "pdmesh-gil0.5ms": System("pdmesh-gil0.5ms", "pdmesh", worker_args=("--kv_gil_switch_interval_s", "0.0005"),
                              description="pdmesh 1P + 1D, a 0.5 ms GIL switch interval in the engines' workers"),
    "pdmesh-spin": System("pdmesh-spin", "pdmesh", worker_args=("--engine_queue_spin_s", "1"),
                          description="pdmesh 1P + 1D, the engines' queues busy-poll 1 s after each message "
                                      "(vLLM's way; before engine_queue_spin_s)"),
    "pdmesh-cond": System("pdmesh-cond", "pdmesh", gateway_args=("--disagg_policy", "conditional"),
                          worker_args=("--kv_gil_switch_interval_s", "0.0005"),
                          description="pdmesh 1P + 1D, conditional disaggregation (decode may prefill locally)"),
}


def bench_flags(base_url: str, model_dir: Path, workload: Workload, point: float, seed: int) -> list[str]:
    load = (["--request-rate", str(point)] if workload.load == "rate"
            else ["--request-rate", "inf", "--max-concurrency", str(int(point))])
    return ["--backend", "openai", "--base-url", base_url, "--endpoint", "/v1/completions",
            "--model", "tiny-llama", "--tokenizer", str(model_dir), *workload.dataset_args,
            "--num-prompts", str(workload.num_prompts), *load, "--ignore-eos", "--seed", str(seed),
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", PERCENTILES,
            "--goodput", f"ttft:{SLO_TTFT_MS:g}", f"tpot:{SLO_TPOT_MS:g}", "--disable-tqdm",
            "--num-warmups", "0", "--ready-check-timeout-sec", "0", "--temperature", "0", "--save-detailed"]


def run_point(base_url: str, model_dir: Path, workload: Workload, point: float, seed: int,
              timeout_s: float) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        command = [sys.executable, "-m", "bench.serve_client", out.name, "--",
                   *bench_flags(base_url, model_dir, workload, point, seed)]
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s,
                              cwd=Path(__file__).resolve().parent.parent)
        if done.returncode != 0:
            raise RuntimeError(f"vllm bench serve failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        return json.loads(Path(out.name).read_text())


KEPT_METRICS = ("completed", "failed", "duration", "request_throughput", "request_goodput", "output_throughput",
                "total_token_throughput")


def per_request(raw: dict) -> list[list[float]]:
    """[TTFT ms, TPOT ms, worst ITL ms] of each completed request: goodput under any other SLO later."""
    requests = []
    for ttft, latency, num_out, itls in zip(raw["ttfts"], raw["latencies"], raw["output_lens"], raw["itls"]):
        if num_out:
            tpot = (latency - ttft) / (num_out - 1) if num_out > 1 else 0.0
            requests.append([round(1e3 * ttft, 2), round(1e3 * tpot, 2), round(1e3 * max(itls, default=0.0), 2)])
    return requests


def summarize(raw: dict) -> dict:
    """The metrics the report uses: throughput, goodput, and p50/p90/p99 of TTFT/TPOT/ITL/E2EL (ms)."""
    kept = {k: raw.get(k) for k in KEPT_METRICS}
    kept["requests"] = per_request(raw)
    for metric in ("ttft", "tpot", "itl", "e2el"):
        kept[f"{metric}_ms"] = {p: raw.get(f"p{p}_{metric}_ms") for p in PERCENTILES.split(",")}
        kept[f"{metric}_ms"]["mean"] = raw.get(f"mean_{metric}_ms")
    completed = kept["completed"] or 0
    kept["slo_attainment"] = (kept["request_goodput"] or 0.0) / kept["request_throughput"] \
        if completed and kept["request_throughput"] else 0.0
    return kept


def run_system(system: System, model_dir: Path, workloads: list[Workload], log_dir: Path,
               timeout_s: float) -> list[dict]:
    rows = []
    started = time.monotonic()
    with start(system, model_dir, log_dir) as base_url:
        print(f"[{system.name}] up in {time.monotonic() - started:.0f}s at {base_url}", flush=True)
        run_point(base_url, model_dir, WARMUP, WARMUP.points[0], seed=999_999, timeout_s=timeout_s)
        for workload_index, workload in enumerate(workloads):
            for index, point in enumerate(workload.points):
                # Fresh prompts at every point (a seed per workload and point): a point must not hit the
                # prefix cache the points before it filled. The same seeds for every system.
                seed = 1000 * (1 + workload_index) + index
                raw = run_point(base_url, model_dir, workload, point, seed=seed, timeout_s=timeout_s)
                row = {"system": system.name, "workload": workload.name, "load": workload.load, "point": point,
                       **summarize(raw)}
                rows.append(row)
                print(f"[{system.name}] {workload.name} {workload.load}={point:g}: "
                      f"out {row['output_throughput']:.0f} tok/s, TTFT p50 {row['ttft_ms']['50']:.0f} ms "
                      f"p90 {row['ttft_ms']['90']:.0f}, TPOT p50 {row['tpot_ms']['50']:.1f} ms, "
                      f"ITL p99 {row['itl_ms']['99']:.0f} ms, goodput {row['request_goodput']:.2f} req/s "
                      f"({row['slo_attainment']:.0%} in SLO)", flush=True)
    return rows


def merged(earlier: dict, now: dict) -> dict:
    """`now` plus what only `earlier` has: a system's workload run again replaces that system's
    earlier rows of it; its other workloads and the other systems keep theirs."""
    rerun = {(row["system"], row["workload"]) for row in now["rows"]}
    kept_rows = [row for row in earlier["rows"] if (row["system"], row["workload"]) not in rerun]
    workloads = {w["name"]: w for w in earlier["workloads"]} | {w["name"]: w for w in now["workloads"]}
    return {**now, "systems": {**earlier["systems"], **now["systems"]}, "workloads": list(workloads.values()),
            "rows": kept_rows + now["rows"],
            "earlier_runs": [*earlier.get("earlier_runs", []), {"machine": earlier["machine"],
                                                                 "systems": sorted({r["system"] for r in kept_rows})}]}


def machine() -> dict:
    import os

    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "num_cpus": os.cpu_count(), "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", choices=sorted(PROFILES), default="full")
    parser.add_argument("--systems", default="vllm,pdmesh,pdmesh-nostore")
    parser.add_argument("--workloads", default="", help="comma-separated subset of the profile's workloads")
    parser.add_argument("--model", default=str(DEFAULT_MODEL_DIR))
    parser.add_argument("--out", default=str(REPORT_DIR), help="folder for serve.json, PNGs")
    parser.add_argument("--report", default=str(REPORT_DIR / "serve_tables.md"),
                        help="the file (beside the plots) whose generated tables are rewritten ('' = none)")
    parser.add_argument("--point-timeout-s", type=float, default=900.0)
    parser.add_argument("--replot", action="store_true",
                        help="run nothing: rewrite the plots and the report's tables from the profile's JSON")
    parser.add_argument("--fresh", action="store_true",
                        help="drop the earlier results (default: keep the rows of systems and workloads not run now)")
    args = parser.parse_args(argv)
    model_dir = ensure_llama(Path(args.model))
    workloads = [w for w in PROFILES[args.profile] if not args.workloads or w.name in args.workloads.split(",")]
    systems = [SYSTEMS[name] for name in args.systems.split(",")]
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / f"serve_{args.profile}.json"
    earlier = json.loads(json_path.read_text()) if json_path.exists() and not args.fresh else None
    with tempfile.TemporaryDirectory(prefix="pdmesh-serve-logs-") as log_dir:
        for system in [] if args.replot else systems:  # results are written after each system: a crash later loses only that one
            rows = run_system(system, model_dir, workloads, Path(log_dir), args.point_timeout_s)
            results = {"machine": machine(), "profile": args.profile,
                       "slo": {"ttft_ms": SLO_TTFT_MS, "tpot_ms": SLO_TPOT_MS},
                       "systems": {system.name: asdict(system)}, "workloads": [asdict(w) for w in workloads],
                       "rows": rows}
            earlier = results if earlier is None else merged(earlier, results)
            json_path.write_text(json.dumps(earlier, indent=1))
    pngs = write_plots(earlier, out_dir)
    if args.report:
        write_report_tables(earlier, Path(args.report))
    print(f"wrote {json_path}, {', '.join(str(p) for p in pngs)}")


if __name__ == "__main__":
    main()

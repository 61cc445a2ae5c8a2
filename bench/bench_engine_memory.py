"""Monolithic vLLM's memory doing a prefill worker's work, with oneDNN's process-wide primitive
cache at oneDNN's default (1024) and off (pdmesh's default, EngineSettings.onednn_primitive_cache_capacity).

Each setting runs one engine (vLLM's LLM, the workers' engine settings, no prefix caching) in a
process group of its own, on the soak's 106 prompts (1 to 500 tokens) drawn at random in batches of
32 with max_tokens=1, for `--seconds`; the group's PSS (the script and the engine's processes) is
sampled every `--sample-every-s`. The settings run one after the other in one invocation.

python -m bench.bench_engine_memory [--seconds 90]

Writes bench/report/engine_memory.{json,png} (bench/results/ with --scratch).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import REPORT_DIR, RESULTS_DIR, write_results
from bench.fault_campaign.resources import group_usage
from bench.fault_campaign.workload import campaign_prompts
from bench.soak import NUM_PREFIXES

CAPACITIES = (1024, 0)   # oneDNN's default, pdmesh's
BATCH = 32


def run_engine(capacity: int, seconds: float, sample_every_s: float) -> dict:
    """One engine's run (in this process, the leader of its process group): samples and requests."""
    from pdmesh.config import DEFAULT_MODEL_DIR, EngineSettings
    from pdmesh.models.tiny import ensure_llama
    from worker.engine import apply_cpu_env, engine_kwargs

    engine = EngineSettings(model=str(ensure_llama(DEFAULT_MODEL_DIR)), omp_threads_bind="0-1",
                            enable_prefix_caching=False, onednn_primitive_cache_capacity=capacity)
    apply_cpu_env(engine)
    from vllm import LLM, SamplingParams

    llm = LLM(**engine_kwargs(engine))
    sampling = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    prompts, rng = campaign_prompts(num_prefixes=NUM_PREFIXES), random.Random(0)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:BATCH]], sampling, use_tqdm=False)  # warm-up
    samples, num_requests, started, next_sample = [], 0, time.monotonic(), 0.0
    while True:
        at_s = time.monotonic() - started
        if at_s >= next_sample:
            samples.append({"at_s": round(at_s, 1), "num_requests": num_requests,
                            "pss_mib": round(group_usage(os.getpgrp()).pss_bytes / 2**20)})
            next_sample += sample_every_s
        if at_s >= seconds:
            return {"capacity": capacity, "samples": samples, "num_requests": num_requests, "seconds": round(at_s, 1)}
        llm.generate([{"prompt_token_ids": p} for p in rng.choices(prompts, k=BATCH)], sampling, use_tqdm=False)
        num_requests += BATCH


def run_setting(capacity: int, seconds: float, sample_every_s: float) -> dict:
    """run_engine in a process group of its own (its engine's processes exit with it)."""
    with tempfile.TemporaryDirectory(prefix="pdmesh-engine-memory-") as work_dir:
        out_path = Path(work_dir) / "run.json"
        done = subprocess.run([sys.executable, "-m", "bench.bench_engine_memory", "--child", str(capacity),
                               "--child-out", str(out_path), "--seconds", str(seconds),
                               "--sample-every-s", str(sample_every_s)],
                              capture_output=True, text=True, timeout=seconds + 600, start_new_session=True)
        if done.returncode != 0:
            raise RuntimeError(f"engine run (capacity {capacity}) failed:\n{done.stderr[-3000:]}")
        return json.loads(out_path.read_text())


def summary(run: dict) -> dict:
    first, last = run["samples"][0], run["samples"][-1]
    return {"capacity": run["capacity"], "pss_start_mib": first["pss_mib"], "pss_end_mib": last["pss_mib"],
            "growth": round(last["pss_mib"] / first["pss_mib"] - 1, 4),
            "kib_per_request": round((last["pss_mib"] - first["pss_mib"]) * 1024 / max(1, run["num_requests"]), 1),
            "requests_per_s": round(run["num_requests"] / run["seconds"], 1)}


def plot(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for run in runs:
        ax.plot([s["num_requests"] for s in run["samples"]], [s["pss_mib"] for s in run["samples"]],
                marker="o", label=f"oneDNN primitive cache {run['capacity']}")
    ax.set_xlabel("prefill requests (max_tokens=1)")
    ax.set_ylabel("PSS of the engine's processes (MiB)")
    ax.set_title("Monolithic vLLM doing a prefill worker's work")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=90.0)
    parser.add_argument("--sample-every-s", type=float, default=10.0)
    parser.add_argument("--scratch", action="store_true", help="write to bench/results/, not the report")
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        Path(args.child_out).write_text(json.dumps(run_engine(args.child, args.seconds, args.sample_every_s)))
        return
    runs = [run_setting(capacity, args.seconds, args.sample_every_s) for capacity in CAPACITIES]
    out_dir = RESULTS_DIR if args.scratch else REPORT_DIR
    results = {"settings": {"seconds": args.seconds, "batch": BATCH}, "machine": platform.platform(),
               "summary": [summary(run) for run in runs], "runs": runs}
    write_results("engine_memory", results, out_dir)
    plot(runs, out_dir / "engine_memory.png")
    print(json.dumps(results["summary"], indent=2))


if __name__ == "__main__":
    main()

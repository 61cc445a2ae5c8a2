"""Runs vLLM's own load generator (`vllm.benchmarks.serve`, what `vllm bench serve` runs) for one
point of a closed-loop or Poisson workload, in a process of its own (nothing of one run, event loop,
connections, tokenizer threads, lingers into the next), and reads back every request's timing.

python -m bench.serving.load_tool OUT.json -- <vllm bench serve flags>   (what `run_point` spawns)
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.serving.goodput import Timing, tpot_ms
from bench.serving.workloads import CLOSED, Workload

REPO_DIR = Path(__file__).resolve().parents[2]


def flags(base_url: str, model_dir: Path, served_name: str, workload: Workload, point: float) -> list[str]:
    load = (["--request-rate", "inf", "--max-concurrency", str(int(point))] if workload.kind == CLOSED
            else ["--request-rate", str(point)])
    return ["--backend", "openai", "--base-url", base_url, "--endpoint", "/v1/completions",
            "--model", served_name, "--tokenizer", str(model_dir), *workload.dataset_args,
            "--num-prompts", str(workload.num_prompts), *load, "--ignore-eos", "--seed", str(workload.seed(point)),
            "--disable-tqdm", "--num-warmups", "0", "--ready-check-timeout-sec", "0", "--temperature", "0",
            "--save-detailed"]


def run_point(base_url: str, model_dir: Path, served_name: str, workload: Workload, point: float,
              timeout_s: float) -> dict:
    """vLLM's result dict of one point (its per-request lists included)."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        command = [sys.executable, "-m", "bench.serving.load_tool", out.name, "--",
                   *flags(base_url, model_dir, served_name, workload, point)]
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, cwd=REPO_DIR)
        if done.returncode != 0:
            raise RuntimeError(f"vllm bench serve failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        return json.loads(Path(out.name).read_text())


def timings(raw: dict) -> list[Timing]:
    """Each completed request's timing, from the tool's per-request lists (a failed one has no output)."""
    found = []
    for ttft, latency, num_out, itls in zip(raw["ttfts"], raw["latencies"], raw["output_lens"], raw["itls"]):
        if num_out:
            found.append(Timing(1e3 * ttft, tpot_ms(latency, ttft, num_out), 1e3 * max(itls, default=0.0)))
    return found


def main(argv: list[str]) -> None:
    out_path, tool_flags = argv[0], argv[argv.index("--") + 1:]
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    result = bench_main(parser.parse_args(tool_flags))
    with open(out_path, "w") as out:
        json.dump(result, out, default=str)


if __name__ == "__main__":
    main(sys.argv[1:])

"""Mesh (gateway -> prefill -> decode) vs monolithic vLLM on the same workload, in one run.

python -m bench.bench_mesh_vs_monolithic [--prompts 16 --prompt-len 64 --output-len 32 --rounds 3]
Each round uses fresh prompts (no prefix-cache help for either side). Prints output tok/s of each,
the ratio, KV bytes moved and transfer GB/s next to memcpy GB/s; writes bench/results/*.json + .png.
Both sides get the machine's two cores: monolithic binds its engine to both, the mesh puts prefill
on core 0 and decode on core 1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import memcpy_gbps, plot_bars, random_prompts, write_results
from pdmesh.client import make_request, stream_generate
from pdmesh.cluster import LocalCluster
from pdmesh.config import DEFAULT_MODEL_DIR
from pdmesh.models.tiny import ensure_llama


def run_monolithic(model_dir: Path, rounds: list[list[list[int]]], output_len: int) -> list[float]:
    sampling = {"max_tokens": output_len, "temperature": 0.0, "ignore_eos": True}
    with tempfile.TemporaryDirectory() as work:
        spec = {"model": str(model_dir), "omp_threads_bind": "0-1",
                "runs": [{"prompts": prompts, "sampling": sampling} for prompts in rounds]}
        (Path(work) / "in.json").write_text(json.dumps(spec))
        subprocess.run([sys.executable, "-m", "worker.baseline", f"{work}/in.json", f"{work}/out.json"],
                       check=True, capture_output=True)
        runs = json.loads((Path(work) / "out.json").read_text())["runs"]
    return [run["seconds"] for run in runs]


async def _timed_generate(address: str, prompt: list[int], output_len: int, started: float):
    """(token ids, last message, seconds to the first token) of one request."""
    token_ids, ttft_s, last = [], 0.0, None
    async for response in stream_generate(address, make_request(prompt, max_tokens=output_len, ignore_eos=True)):
        if response.token_ids and not token_ids:
            ttft_s = time.perf_counter() - started
        token_ids.extend(response.token_ids)
        last = response
    return token_ids, last, ttft_s


async def run_mesh_round(address: str, prompts: list[list[int]], output_len: int) -> dict:
    started = time.perf_counter()
    results = await asyncio.gather(*(_timed_generate(address, p, output_len, started) for p in prompts))
    seconds = time.perf_counter() - started
    transfers = [last.transfer for _, last, _ in results]
    return {
        "seconds": seconds,
        "ttft_seconds": [ttft for _, _, ttft in results],
        "num_output_tokens": sum(len(ids) for ids, _, _ in results),
        "kv_bytes": sum(t.num_bytes for t in transfers),
        "kv_blocks": sum(t.num_blocks for t in transfers),
        "kv_gbps_per_transfer": [t.num_bytes / t.seconds / 1e9 for t in transfers if t.seconds > 0],
        "kv_seconds_per_transfer": [t.seconds for t in transfers],
        "kv_first_block_seconds_per_transfer": [t.first_block_seconds for t in transfers],
    }


def run_mesh(model_dir: Path, rounds: list[list[list[int]]], output_len: int, worker_bind: str | None,
             first_token_from: str) -> list[dict]:
    worker_args = ["--engine.omp_threads_bind", worker_bind] if worker_bind else []
    with tempfile.TemporaryDirectory() as run_dir, \
            LocalCluster(model_dir, Path(run_dir), worker_args=worker_args,
                         gateway_args=["--first_token_from", first_token_from]) as cluster:
        asyncio.run(run_mesh_round(cluster.gateway_address, random_prompts(2, 16, seed=-1), 2))  # warm-up
        return [asyncio.run(run_mesh_round(cluster.gateway_address, prompts, output_len)) for prompts in rounds]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(DEFAULT_MODEL_DIR))
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--first-token-from", choices=["decode", "prefill"], default="decode")
    parser.add_argument("--worker-bind", default=None,
                        help="OMP cores for every worker (e.g. 0-1); default: prefill core 0, decode core 1")
    args = parser.parse_args()
    model_dir = ensure_llama(Path(args.model))
    rounds = [random_prompts(args.prompts, args.prompt_len, seed=r) for r in range(args.rounds)]
    num_output_tokens = args.prompts * args.output_len

    mono_seconds = run_monolithic(model_dir, rounds, args.output_len)
    mesh_rounds = run_mesh(model_dir, rounds, args.output_len, args.worker_bind, args.first_token_from)
    memcpy = memcpy_gbps()

    mono_tps = statistics.median(num_output_tokens / s for s in mono_seconds)
    mesh_tps = statistics.median(r["num_output_tokens"] / r["seconds"] for r in mesh_rounds)
    kv_gbps = statistics.median(g for r in mesh_rounds for g in r["kv_gbps_per_transfer"])
    ttft_ms = statistics.median(s * 1e3 for r in mesh_rounds for s in r["ttft_seconds"])
    kv_ms = statistics.median(s * 1e3 for r in mesh_rounds for s in r["kv_seconds_per_transfer"])
    first_block_ms = statistics.median(s * 1e3 for r in mesh_rounds for s in r["kv_first_block_seconds_per_transfer"])
    results = {
        "workload": vars(args),
        "monolithic_output_tok_s": mono_tps,
        "mesh_output_tok_s": mesh_tps,
        "mesh_over_monolithic": mesh_tps / mono_tps,
        "mesh_ttft_ms_median": ttft_ms,
        "kv_bytes_per_round": mesh_rounds[0]["kv_bytes"],
        "kv_blocks_per_round": mesh_rounds[0]["kv_blocks"],
        "kv_transfer_gbps_median": kv_gbps,
        "kv_transfer_ms_median": kv_ms,
        "kv_first_block_ms_median": first_block_ms,
        "memcpy_gbps_median": memcpy,
        "kv_over_memcpy": kv_gbps / memcpy,
        "raw": {"monolithic_seconds": mono_seconds, "mesh_rounds": mesh_rounds},
    }
    name = "mesh_vs_monolithic" + (f"_bind{args.worker_bind}" if args.worker_bind else "") + \
        ("_first_token_from_prefill" if args.first_token_from == "prefill" else "")
    json_path = write_results(name, results)
    png_path = plot_bars(name, [
        ("output tok/s (median)", {"monolithic": mono_tps, "mesh": mesh_tps}),
        ("GB/s (median)", {"KV over gRPC": kv_gbps, "memcpy": memcpy}),
    ])
    print(f"monolithic {mono_tps:.1f} tok/s | mesh {mesh_tps:.1f} tok/s | mesh/monolithic {mesh_tps / mono_tps:.2f} "
          f"| mesh TTFT median {ttft_ms:.0f} ms (first token from {args.first_token_from})")
    print(f"KV moved per round: {results['kv_bytes_per_round'] / 2**20:.1f} MiB in {results['kv_blocks_per_round']} "
          f"blocks | per-transfer median {kv_ms:.1f} ms (first block after {first_block_ms:.1f} ms), "
          f"{kv_gbps:.3f} GB/s | memcpy {memcpy:.2f} GB/s "
          f"| KV/memcpy {kv_gbps / memcpy:.3f}")
    print(f"wrote {json_path} and {png_path}")


if __name__ == "__main__":
    main()

"""Time to first token on an idle system, one long prompt at a time: what disaggregation costs
before any load, and where it goes.

python -m bench.bench_idle_ttft [--requests 8 --prompt-len 2000 --output-len 8]

Monolithic vLLM (its OpenAI server, one engine on both cores), then pdmesh (the static split,
`pdmesh up --prefill 1 --decode 1`: gateway + prefill on core 0 + decode on core 1; its OpenAI API
for TTFT, like vLLM's, and the same prompts over gRPC afterwards for the per-request transfer
figures: the decode's KV pull and its first block). Fresh prompts for every request, so no prefix
cache helps. Medians and ratios; writes bench/report/idle_ttft.json and .png (`--out` names
another pair).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

import aiohttp

from bench.common import REPORT_DIR, plot_bars, random_prompts
from bench.serving.arms import System, monolithic_vllm
from pdmesh.client import make_request, stream_generate
from pdmesh.cluster import LocalCluster
from pdmesh.config import DEFAULT_MODEL_DIR
from pdmesh.models.tiny import ensure_llama


async def _http_ttft(base_url: str, prompts: list[list[int]], output_len: int) -> list[float]:
    ttfts = []
    async with aiohttp.ClientSession() as session:
        for prompt in prompts:
            body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": output_len, "temperature": 0,
                    "ignore_eos": True, "stream": True}
            started = time.perf_counter()
            async with session.post(f"{base_url}/v1/completions", json=body) as response:
                response.raise_for_status()
                first = 0.0
                async for line in response.content:
                    if not first and line.startswith(b"data: {"):
                        first = time.perf_counter() - started
            ttfts.append(first)
    return ttfts


async def _grpc_transfers(address: str, prompts: list[list[int]], output_len: int) -> list[dict]:
    transfers = []
    for prompt in prompts:
        started, first = time.perf_counter(), 0.0
        async for response in stream_generate(address, make_request(prompt, max_tokens=output_len, ignore_eos=True)):
            if response.token_ids and not first:
                first = time.perf_counter() - started
            if response.HasField("transfer"):
                transfer = response.transfer
        transfers.append({"ttft_s": first, "pull_s": transfer.seconds, "first_block_s": transfer.first_block_seconds,
                          "num_blocks": transfer.num_blocks})
    return transfers


def _median_ms(values: list[float]) -> float:
    return 1e3 * statistics.median(values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=2000)
    parser.add_argument("--output-len", type=int, default=8)
    parser.add_argument("--worker-args", default="", help="extra flags for pdmesh's workers, space-separated")
    parser.add_argument("--skip-vllm", action="store_true", help="pdmesh only (vLLM's figures stay 0)")
    parser.add_argument("--out", default="idle_ttft", help="name of the JSON and PNG in bench/report")
    args = parser.parse_args()
    model_dir = ensure_llama(DEFAULT_MODEL_DIR)
    prompts = iter(random_prompts(3 * args.requests + 3, args.prompt_len, seed=4242))

    def batch() -> list[list[int]]:
        return [next(prompts) for _ in range(args.requests)]

    with tempfile.TemporaryDirectory() as work:
        log_dir = Path(work)
        vllm = [0.0]
        if not args.skip_vllm:
            with monolithic_vllm(System("vllm", "vllm", cores="0-1"), model_dir, log_dir) as base_url:
                asyncio.run(_http_ttft(base_url, [next(prompts)], args.output_len))  # warm-up
                vllm = asyncio.run(_http_ttft(base_url, batch(), args.output_len))
        with LocalCluster(model_dir, log_dir / "pdmesh", gateway_args=["--http_port", "0"],
                          worker_args=args.worker_args.split(), store_dir=log_dir / "store") as cluster:  # what bench.serve's `pdmesh` runs
            base_url, grpc_address = f"http://{cluster.http_address}", cluster.gateway_address
            asyncio.run(_http_ttft(base_url, [next(prompts)], args.output_len))  # warm-up
            pdmesh = asyncio.run(_http_ttft(base_url, batch(), args.output_len))
            transfers = asyncio.run(_grpc_transfers(grpc_address, batch(), args.output_len))
    medians = {"vllm_ttft_ms": _median_ms(vllm), "pdmesh_ttft_ms": _median_ms(pdmesh),
               "pdmesh_grpc_ttft_ms": _median_ms([t["ttft_s"] for t in transfers]),
               "pdmesh_pull_ms": _median_ms([t["pull_s"] for t in transfers]),
               "pdmesh_first_block_ms": _median_ms([t["first_block_s"] for t in transfers])}
    results = {"workload": vars(args), "medians": medians,
               "ratio_pdmesh_over_vllm": medians["pdmesh_ttft_ms"] / max(medians["vllm_ttft_ms"], 1e-9),
               "vllm_ttft_s": vllm, "pdmesh_ttft_s": pdmesh, "pdmesh_transfers": transfers}
    REPORT_DIR.mkdir(parents=True, exist_ok=True)
    (REPORT_DIR / f"{args.out}.json").write_text(json.dumps(results, indent=1))
    plot_bars(args.out, [(f"idle TTFT p50, {args.prompt_len}-token prompts (ms)", {
        "vLLM": medians["vllm_ttft_ms"], "pdmesh": medians["pdmesh_ttft_ms"],
        "pdmesh: KV pull": medians["pdmesh_pull_ms"]})], out_dir=REPORT_DIR)
    print("idle TTFT p50: " + ", ".join(f"{k} {v:.0f}" for k, v in medians.items())
          + f" | pdmesh/vLLM {results['ratio_pdmesh_over_vllm']:.2f}x")


if __name__ == "__main__":
    main()

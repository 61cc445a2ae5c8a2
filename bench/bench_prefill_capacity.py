"""Prefill capacity: prompt tokens/s at saturation of a pdmesh prefill worker vs monolithic vLLM.

python -m bench.bench_prefill_capacity [--prompts 24 --prompt-len 2000 --rounds 3]

All on core 0, the core a static split (`pdmesh up --prefill 1 --decode 1`) gives its prefill
worker: (a) monolithic vLLM's OpenAI server running the prompts with max_tokens=1; (b) a pdmesh
prefill worker with its KV store off and (c) on (device, DRAM and NVMe tiers), sent Prefill RPCs
and releasing each KV handle at once, as the gateway does when decode has pulled. Each round sends
all its prompts at once (fresh prompts every round, so no cache helps) and measures the wall time
to the last answer. Writes bench/report/prefill_capacity.json and .png; the serving issue's
targets are (b)/(a) >= 0.9 and (c)/(b) >= 0.9.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import statistics
import tempfile
import time
from pathlib import Path

import aiohttp

from bench.common import REPORT_DIR, plot_bars, random_prompts
from bench.serving.arms import System, monolithic_vllm, spawned
from pdmesh.config import DEFAULT_MODEL_DIR, TlsSettings
from pdmesh.models.tiny import ensure_llama
from pdmesh.tls import open_channel
from pdmesh.v1 import worker_pb2, worker_pb2_grpc

MESH_TOKEN = secrets.token_urlsafe(24)   # the prefill workers' (their port asks for it)


def prefill_worker(model_dir: Path, log_dir: Path, name: str, args: list[str]):
    """A `python -m prefill` on core 0; yields its ready record (address, kv_address)."""
    ready = log_dir / f"{name}.ready.json"
    return spawned(["-m", "prefill", "--port", "0", "--engine.model", str(model_dir), "--engine.omp_threads_bind",
                    "0", "--ready_file", str(ready), "--exit_with_parent", *args], ready, log_dir / f"{name}.log",
                   env={**os.environ, "PDMESH_WORKER_MESH_TOKEN": MESH_TOKEN})


async def _prefill_round(record: dict, prompts: list[list[int]], tag: str) -> float:
    async with open_channel(record["address"], TlsSettings(), mesh_token=MESH_TOKEN) as channel:
        prefill = worker_pb2_grpc.PrefillStub(channel)

        async def one(i: int, prompt: list[int]) -> None:
            response = await prefill.Prefill(worker_pb2.PrefillRequest(request_id=f"{tag}-{i}",
                                                                       prompt_token_ids=prompt), timeout=600)
            await prefill.Release(worker_pb2.ReleaseKVRequest(transfer_id=response.kv.transfer_id), timeout=30)

        started = time.perf_counter()
        await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        return time.perf_counter() - started


async def _vllm_round(base_url: str, prompts: list[list[int]]) -> float:
    async with aiohttp.ClientSession() as session:
        async def one(prompt: list[int]) -> None:
            body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": 1, "temperature": 0}
            async with session.post(f"{base_url}/v1/completions", json=body) as response:
                response.raise_for_status()
                await response.read()

        started = time.perf_counter()
        await asyncio.gather(*(one(p) for p in prompts))
        return time.perf_counter() - started


def measure(name: str, run_round, rounds: list[list[list[int]]]) -> dict:
    asyncio.run(run_round(random_prompts(2, 64, seed=-1), "warmup"))
    seconds = [asyncio.run(run_round(prompts, f"r{i}")) for i, prompts in enumerate(rounds)]
    num_tokens = sum(len(p) for p in rounds[0])
    tok_s = statistics.median(num_tokens / s for s in seconds)
    print(f"{name}: {tok_s:,.0f} prompt tok/s (rounds {', '.join(f'{s:.2f}' for s in seconds)} s)", flush=True)
    return {"seconds": seconds, "prompt_tokens_per_s": tok_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(DEFAULT_MODEL_DIR))
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--prompt-len", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    model_dir = ensure_llama(Path(args.model))
    results = {"workload": vars(args)}
    with tempfile.TemporaryDirectory(prefix="pdmesh-capacity-") as work:
        log_dir = Path(work)
        fresh = iter(range(1000))

        def rounds() -> list[list[list[int]]]:  # prompts no engine has seen, per system
            return [random_prompts(args.prompts, args.prompt_len, seed=next(fresh)) for _ in range(args.rounds)]

        with monolithic_vllm(System("vllm-core0", "vllm", cores="0"), model_dir, log_dir,
                             kv_cache_space_gib=1) as base_url:
            results["vllm"] = measure("monolithic vLLM, core 0, max_tokens=1",
                                      lambda prompts, tag: _vllm_round(base_url, prompts), rounds())
        with prefill_worker(model_dir, log_dir, "nostore", ["--no-store.enabled"]) as record:
            results["prefill_nostore"] = measure("pdmesh prefill, store off",
                                                 lambda prompts, tag: _prefill_round(record, prompts, tag), rounds())
        with prefill_worker(model_dir, log_dir, "store", ["--store.nvme_dir", str(log_dir / "nvme")]) as record:
            results["prefill_store"] = measure("pdmesh prefill, store on",
                                               lambda prompts, tag: _prefill_round(record, prompts, tag), rounds())
    vllm, nostore, store = (results[k]["prompt_tokens_per_s"] for k in ("vllm", "prefill_nostore", "prefill_store"))
    results["prefill_nostore_over_vllm"] = nostore / vllm
    results["store_over_nostore"] = store / nostore
    REPORT_DIR.mkdir(parents=True, exist_ok=True)
    (REPORT_DIR / "prefill_capacity.json").write_text(json.dumps(results, indent=1))
    plot_bars("prefill_capacity", [("prompt tok/s at saturation, core 0", {
        "vLLM": vllm, "prefill, store off": nostore, "prefill, store on": store})], out_dir=REPORT_DIR)
    print(f"prefill(store off)/vLLM {nostore / vllm:.2f} (target >= 0.9); store on/off {store / nostore:.2f} "
          f"(target >= 0.9)")


if __name__ == "__main__":
    main()

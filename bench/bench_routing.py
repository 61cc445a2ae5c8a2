"""Prefix-aware routing vs round robin, measured side by side in one run.

python -m bench.bench_routing [--docs 6 --turns 4 --prefix-len 1024 --suffix-len 32]

One cluster: 2 prefill workers (engine prefix cache on, KV stores sharing a real Redis index) and
1 decode. Each "document" is a long prefix asked about several times with new suffixes (a
multi-turn chat, a RAG context): under round robin a follow-up lands on either prefill worker and
loads the prefix from wherever it is (often another node's store); under prefix_aware it goes to
the worker holding it. Requests run one at a time with the first token from prefill, so TTFT is
prefill's work. Each policy gets its own documents (no shared cache between the two).

Prints median TTFT of follow-ups, prefill tokens computed, and where cached tokens came from;
writes bench/results/routing.json and .png.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path

from bench.common import plot_bars, random_prompts, write_results
from gateway.server import Gateway
from pdmesh.client import make_request, stream_generate
from pdmesh.cluster import LocalCluster
from pdmesh.config import DEFAULT_MODEL_DIR, GatewaySettings
from pdmesh.models.tiny import ensure_llama
from tests.redis_server import RedisServer

POLICIES = ("round_robin", "prefix_aware")


async def _request(address: str, prompt: list[int]) -> tuple[float, object]:
    """TTFT and the final response (with its transfer stats)."""
    started, ttft, last = time.perf_counter(), None, None
    async for response in stream_generate(address, make_request(prompt, max_tokens=2, ignore_eos=True)):
        if ttft is None and response.token_ids:
            ttft = time.perf_counter() - started
        last = response
    return ttft, last


async def _run_policy(cluster: LocalCluster, redis: RedisServer, policy: str, args, seed: int) -> dict:
    settings = GatewaySettings(port=0, prefill_workers=cluster.prefill_addresses,
                               decode_workers=cluster.decode_addresses, tokenizer=str(cluster.model_dir),
                               route_policy=policy, kv_index_redis_url=redis.url,
                               kv_index_redis_password=redis.password, first_token_from="prefill")
    gateway = Gateway(settings)
    address = await gateway.start()
    docs = random_prompts(args.docs, args.prefix_len, seed=seed)
    suffixes = iter(random_prompts(args.docs * args.turns, args.suffix_len, seed=seed + 1))
    ttfts, computed, sources = [], 0, Counter()
    try:
        for turn in range(args.turns):
            for doc in docs:
                ttft, last = await _request(address, doc + next(suffixes)[1:])
                computed += last.transfer.prefill_computed_tokens
                if turn > 0:   # follow-ups: the prefix was computed once already
                    ttfts.append(ttft)
                    sources.update(dict(last.transfer.prefill_store_tokens))
                    sources["engine_cache"] += last.transfer.prefill_cached_tokens - sum(
                        last.transfer.prefill_store_tokens.values())
            await asyncio.sleep(0.3)  # saves run after each request, in the background
    finally:
        await gateway.stop(0)
    return {"followup_ttft_median_s": statistics.median(ttfts), "prefill_computed_tokens": computed,
            "cached_tokens_by_source": dict(sources), "num_followups": len(ttfts)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--docs", type=int, default=6)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--prefix-len", type=int, default=1024)
    parser.add_argument("--suffix-len", type=int, default=32)
    parser.add_argument("--model", default=str(DEFAULT_MODEL_DIR))
    args = parser.parse_args()
    model_dir = ensure_llama(Path(args.model))
    work = Path(tempfile.mkdtemp(prefix="pdmesh-bench-routing-"))
    redis = RedisServer(work, password="bench").start()
    worker_args = ["--store.redis_url", redis.url, "--store.redis_password", redis.password]
    try:
        with LocalCluster(model_dir, work / "cluster", num_prefill=2, worker_args=worker_args,
                          store_dir=work / "nvme") as cluster:
            results = {policy: asyncio.run(_run_policy(cluster, redis, policy, args, seed=100 * (i + 1)))
                       for i, policy in enumerate(POLICIES)}
    finally:
        redis.stop()
    rr, pa = results["round_robin"], results["prefix_aware"]
    results["ttft_ratio_prefix_aware_over_round_robin"] = pa["followup_ttft_median_s"] / rr["followup_ttft_median_s"]
    results["config"] = vars(args)
    for policy in POLICIES:
        r = results[policy]
        print(f"{policy:13s} follow-up TTFT median {r['followup_ttft_median_s'] * 1e3:7.1f} ms; prefill computed "
              f"{r['prefill_computed_tokens']} tokens; cached by source {r['cached_tokens_by_source']}")
    print(f"prefix_aware / round_robin TTFT: {results['ttft_ratio_prefix_aware_over_round_robin']:.2f}")
    write_results("routing", results)
    plot_bars("routing", [("follow-up TTFT median (ms)", {p: results[p]["followup_ttft_median_s"] * 1e3
                                                           for p in POLICIES}),
                          ("prefill tokens computed", {p: results[p]["prefill_computed_tokens"] for p in POLICIES})])


if __name__ == "__main__":
    main()

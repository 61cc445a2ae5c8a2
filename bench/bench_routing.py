"""Prefix-aware routing vs round robin, measured side by side in one run.

python -m bench.bench_routing [--docs 5 --turns 4 --prefix-len 1024 --suffix-len 32 --pause-s 0.5]

One cluster: 2 prefill workers (engine prefix cache on, KV stores sharing a real Redis index) and
1 decode. Each "document" is a long prefix asked about several times with new suffixes (a
multi-turn chat, a RAG context): under round robin a follow-up lands on either prefill worker and
loads the prefix from wherever it is (often another node's store); under prefix_aware it goes to
the worker holding it. Requests run one at a time with the first token from prefill, so TTFT is
prefill's work. Each policy gets its own documents (no shared cache between the two) and its own
gateway; the two policies' requests alternate so the machine's noise hits both alike. An odd number
of documents makes round robin send each follow-up to the other worker than the turn before.

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
from dataclasses import dataclass, field
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


@dataclass
class PolicyRun:
    """One policy's gateway, its own documents, and what its requests measured."""
    policy: str
    address: str
    docs: list[list[int]]
    suffixes: list[list[int]]
    ttfts: list[float] = field(default_factory=list)
    cold_ttfts: list[float] = field(default_factory=list)
    ttfts_by_source: dict[str, list[float]] = field(default_factory=dict)
    computed_tokens: int = 0
    sources: Counter = field(default_factory=Counter)

    async def ask(self, turn: int, doc_index: int) -> None:
        suffix = self.suffixes[turn * len(self.docs) + doc_index]
        ttft, last = await _request(self.address, self.docs[doc_index] + suffix[1:])
        self.computed_tokens += last.transfer.prefill_computed_tokens
        if turn == 0:
            self.cold_ttfts.append(ttft)
        else:   # follow-ups: the prefix was computed once already
            self.ttfts.append(ttft)
            store_tokens = dict(last.transfer.prefill_store_tokens)
            source = "engine_cache" if not store_tokens else "+".join(sorted(store_tokens))
            self.ttfts_by_source.setdefault(source, []).append(ttft)
            self.sources.update(store_tokens)
            self.sources["engine_cache"] += last.transfer.prefill_cached_tokens - sum(
                last.transfer.prefill_store_tokens.values())

    def summary(self) -> dict:
        local = self.ttfts_by_source.get("engine_cache", [])
        return {"cold_ttft_median_s": statistics.median(self.cold_ttfts),
                "followup_ttft_median_s": statistics.median(self.ttfts),
                "followup_local_hit_fraction": len(local) / len(self.ttfts), "followup_ttfts_s": self.ttfts,
                "followup_ttft_median_s_by_source": {source: statistics.median(ttfts)
                                                     for source, ttfts in self.ttfts_by_source.items()},
                "num_followups_by_source": {source: len(ttfts) for source, ttfts in self.ttfts_by_source.items()},
                "prefill_computed_tokens": self.computed_tokens, "cached_tokens_by_source": dict(self.sources),
                "num_followups": len(self.ttfts)}


async def _start_gateway(cluster: LocalCluster, redis: RedisServer, policy: str) -> tuple[Gateway, str]:
    settings = GatewaySettings(port=0, prefill_workers=cluster.prefill_addresses, mesh_token=cluster.mesh_token,
                               decode_workers=cluster.decode_addresses, tokenizer=str(cluster.model_dir),
                               route_policy=policy, kv_index_redis_url=redis.url,
                               kv_index_redis_password=redis.password, first_token_from="prefill")
    gateway = Gateway(settings)
    return gateway, await gateway.start()


async def _run_side_by_side(cluster: LocalCluster, redis: RedisServer, args) -> dict:
    """Both policies' requests interleaved (one at a time), so machine noise hits both alike."""
    gateways = {policy: await _start_gateway(cluster, redis, policy) for policy in POLICIES}
    try:
        runs = [PolicyRun(policy, address, random_prompts(args.docs, args.prefix_len, seed=100 * (i + 1)),
                          random_prompts(args.docs * args.turns, args.suffix_len, seed=100 * (i + 1) + 1))
                for i, (policy, (_, address)) in enumerate(gateways.items())]
        for warmup in random_prompts(2 * len(cluster.prefill_addresses), args.prefix_len + args.suffix_len, seed=7):
            await _request(runs[0].address, warmup)   # round robin over both prefills: each runs the shapes once
        for turn in range(args.turns):
            for doc_index in range(args.docs):
                for run in runs:
                    await run.ask(turn, doc_index)
                    await asyncio.sleep(args.pause_s)  # saves run after each request, in the background
        return {run.policy: run.summary() for run in runs}
    finally:
        for gateway, _ in gateways.values():
            await gateway.stop(0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--docs", type=int, default=5)
    parser.add_argument("--pause-s", type=float, default=0.5)
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
            results = asyncio.run(_run_side_by_side(cluster, redis, args))
    finally:
        redis.stop()
    rr, pa = results["round_robin"], results["prefix_aware"]
    results["ttft_ratio_prefix_aware_over_round_robin"] = pa["followup_ttft_median_s"] / rr["followup_ttft_median_s"]
    results["config"] = vars(args)
    for policy in POLICIES:
        r = results[policy]
        print(f"{policy:13s} first-turn (cold) TTFT median {r['cold_ttft_median_s'] * 1e3:7.1f} ms; "
              f"follow-up TTFT median {r['followup_ttft_median_s'] * 1e3:7.1f} ms; prefill computed "
              f"{r['prefill_computed_tokens']} tokens; cached by source {r['cached_tokens_by_source']}")
        for source, median in r["followup_ttft_median_s_by_source"].items():
            print(f"{'':13s}   {r['num_followups_by_source'][source]:3d} follow-ups loaded from {source}: "
                  f"TTFT median {median * 1e3:7.1f} ms")
    print(f"prefix_aware / round_robin TTFT: {results['ttft_ratio_prefix_aware_over_round_robin']:.2f}")
    write_results("routing", results)
    plot_bars("routing", [("follow-up TTFT median (ms)", {p: results[p]["followup_ttft_median_s"] * 1e3
                                                           for p in POLICIES}),
                          ("follow-ups hitting the local engine cache (%)",
                           {p: results[p]["followup_local_hit_fraction"] * 100 for p in POLICIES})])


if __name__ == "__main__":
    main()

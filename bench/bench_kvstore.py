"""The tiered KV store, measured side by side in one run.

python -m bench.bench_kvstore [--rounds 5 --prompt-len 2048 --cached-len 1984 --tier-mib 128]

1. TTFT of a 2,048-token prompt: cold (nothing cached) vs with its first 1,984 tokens in the
   prefill worker's KV store, on the DRAM tier vs the NVMe tier (forced there with SpillKV). One
   cluster (1 prefill with its engine prefix cache off, so every hit is the store's; 1 decode),
   first token from prefill, so TTFT is the prefill's work. Fresh prompts every round.
2. Tier bandwidth with real KV blocks (128 KiB) in batches of 64 (one 2,048-token prompt, what
   the store moves per save or load): DRAM and NVMe tier write/read, and the whole store's
   put/read (checksums, LRU), against memcpy and raw disk (dd with O_DIRECT) on the same machine,
   in the same run. NVMe writes are durable (fdatasync per batch); NVMe reads are cold (the slab
   is dropped from the page cache first).

Prints medians and ratios; writes bench/report/kvstore.json and .png (committed with bench/REPORT.md).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import re
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.common import REPORT_DIR, memcpy_gbps, plot_bars, random_prompts, write_results
from kvstore.block_key import block_keys
from kvstore.block_store import TieredBlockStore
from kvstore.disk_tier import DiskTier
from kvstore.slab_tier import host_tier
from pdmesh.client import make_request, stream_generate
from pdmesh.cluster import LocalCluster
from pdmesh.config import DEFAULT_MODEL_DIR, TlsSettings
from pdmesh.models.tiny import ensure_llama
from pdmesh.tls import open_channel
from pdmesh.v1 import worker_pb2, worker_pb2_grpc

BLOCK_NBYTES = 4 * 2 * 32 * 128 * 4  # the tiny Llama's block: layers * (K,V) * block_size * kv width * fp32


# ---- 1. TTFT ----
async def _ttft(address: str, prompt: list[int]) -> float:
    started = time.perf_counter()
    async for response in stream_generate(address, make_request(prompt, max_tokens=2, ignore_eos=True)):
        if response.token_ids:
            return time.perf_counter() - started
    raise RuntimeError("no token")


async def _spill(cluster: LocalCluster, tier: str) -> None:
    async with open_channel(cluster.prefill_addresses[0], TlsSettings(), mesh_token=cluster.mesh_token) as channel:
        await worker_pb2_grpc.WorkerInfoStub(channel).SpillKV(worker_pb2.SpillKVRequest(tier=tier))


async def _ttft_rounds(cluster: LocalCluster, args) -> dict[str, list[float]]:
    samples: dict[str, list[float]] = {"cold": [], "dram": [], "nvme": []}
    prompts = iter(random_prompts(8 * (args.rounds + 1), args.prompt_len, seed=2048))
    await _ttft(cluster.gateway_address, next(prompts))  # warm-up
    for _ in range(args.rounds):
        samples["cold"].append(await _ttft(cluster.gateway_address, next(prompts)))
        for tier in ("dram", "nvme"):
            warm, measured = next(prompts), next(prompts)
            measured[:args.cached_len] = warm[:args.cached_len]  # shares exactly cached_len tokens
            await _ttft(cluster.gateway_address, warm)
            await asyncio.sleep(0.3)  # the save runs after the request, in the background
            await _spill(cluster, tier)
            samples[tier].append(await _ttft(cluster.gateway_address, measured))
    return samples


# ---- 2. bandwidth ----
def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def _timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def _drop_page_cache(directory: Path) -> None:
    for path in directory.iterdir():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _batches(num_blocks: int, batch_blocks: int) -> list[range]:
    return [range(i, min(i + batch_blocks, num_blocks)) for i in range(0, num_blocks, batch_blocks)]


def _tier_round_trip(tier, keys, rows: np.ndarray, batch_blocks: int, before_read=lambda: None) -> tuple[float, float]:
    """(write GB/s, read GB/s) of the whole set moved in batches of batch_blocks blocks."""
    batches, handles = _batches(len(keys), batch_blocks), []
    out = np.zeros((batch_blocks, rows.shape[1]), dtype=np.uint8)  # the reader's reused buffer

    def write():
        for batch in batches:
            slots = tier.allocate(len(batch))
            tier.write_many(slots, keys[batch.start:batch.stop], rows[:len(batch)], [0] * len(batch))
            handles.append(slots)

    def read():
        for slots in handles:
            tier.read_many(slots, out[:len(slots)])

    nbytes = len(keys) * rows.shape[1]
    write_gbps = _gbps(nbytes, _timed(write))
    before_read()
    return write_gbps, _gbps(nbytes, _timed(read))


def _tier_bandwidth(num_blocks: int, batch_blocks: int, work: Path) -> dict[str, float]:
    """Each tier and the whole store moving `num_blocks` real-size blocks in batches of
    `batch_blocks` (a 2,048-token prompt is 64 blocks): the batched copies the store makes."""
    keys = block_keys(b"bench", list(range(num_blocks * 32)), 32)
    rows = np.random.default_rng(0).integers(0, 255, (batch_blocks, BLOCK_NBYTES), dtype=np.uint8)
    nbytes = num_blocks * BLOCK_NBYTES
    dram = host_tier(nbytes, BLOCK_NBYTES)
    dram.write_many(dram.allocate(num_blocks), keys, np.zeros((num_blocks, BLOCK_NBYTES), np.uint8),
                    [0] * num_blocks)  # first touch of the slab's pages, not timed
    for slot in range(num_blocks):
        dram.free(slot)
    results = dict(zip(("dram_write", "dram_read"), _tier_round_trip(dram, keys, rows, batch_blocks)))
    disk = DiskTier(work / "tier", nbytes, BLOCK_NBYTES)
    results.update(zip(("nvme_write", "nvme_read"), _tier_round_trip(
        disk, keys, rows, batch_blocks, before_read=lambda: _drop_page_cache(work / "tier"))))
    disk.close()
    store = TieredBlockStore([host_tier(nbytes, BLOCK_NBYTES)], BLOCK_NBYTES)
    store.put_many(keys, np.zeros((num_blocks, BLOCK_NBYTES), np.uint8))  # first touch, not timed
    store.clear()
    batches = _batches(num_blocks, batch_blocks)
    results["store_put"] = _gbps(nbytes, _timed(
        lambda: [store.put_many(keys[b.start:b.stop], rows[:len(b)]) for b in batches]))
    out = np.zeros((batch_blocks, BLOCK_NBYTES), dtype=np.uint8)  # the reader's reused buffer
    results["store_read"] = _gbps(nbytes, _timed(
        lambda: [store.read_prefix(keys[b.start:b.stop], out) for b in batches]))
    return results


def _dd_gbps(args: list[str]) -> float:
    out = subprocess.run(["dd", *args], capture_output=True, text=True, check=True).stderr
    value, unit = re.search(r"([\d.,]+) ([kMG]?B)/s", out).groups()
    return float(value.replace(",", ".")) * {"B": 1e-9, "kB": 1e-6, "MB": 1e-3, "GB": 1.0}[unit]


def _raw_disk(nbytes: int, work: Path) -> dict[str, float]:
    target = work / "dd.bin"
    count = max(1, nbytes >> 20)
    write = _dd_gbps(["if=/dev/zero", f"of={target}", "bs=1M", f"count={count}", "oflag=direct", "conv=fsync"])
    read = _dd_gbps([f"if={target}", "of=/dev/null", "bs=1M", "iflag=direct"])
    target.unlink()
    return {"dd_direct_write": write, "dd_direct_read": read}


def _bandwidth_medians(num_blocks: int, args, work: Path) -> dict[str, float]:
    """Medians over `repeats` rounds, each the tiers then dd then memcpy back to back (this
    machine's disk is shared and its speed drifts between seconds: interleaving keeps each ratio
    to its anchor fair)."""
    rounds = []
    for round_index in range(args.repeats):
        round_dir = work / f"round-{round_index}"
        round_dir.mkdir()
        rounds.append({**_tier_bandwidth(num_blocks, args.batch_blocks, round_dir),
                       **_raw_disk(num_blocks * BLOCK_NBYTES, round_dir), "memcpy": memcpy_gbps()})
    return {name: statistics.median(r[name] for r in rounds) for name in rounds[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(DEFAULT_MODEL_DIR))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompt-len", type=int, default=2048)
    parser.add_argument("--cached-len", type=int, default=1984)
    parser.add_argument("--tier-mib", type=int, default=128)
    parser.add_argument("--batch-blocks", type=int, default=64, help="blocks per tier batch (64 = 2,048 tokens)")
    parser.add_argument("--repeats", type=int, default=5, help="bandwidth rounds (medians are reported)")
    parser.add_argument("--skip-ttft", action="store_true", help="tier bandwidth only (no cluster)")
    args = parser.parse_args()
    model_dir = ensure_llama(Path(args.model))
    with tempfile.TemporaryDirectory() as run_dir:
        work = Path(run_dir)
        samples = {"cold": [math.nan], "dram": [math.nan], "nvme": [math.nan]}
        if not args.skip_ttft:
            with LocalCluster(model_dir, work / "cluster", store_dir=work / "nvme",
                              worker_args=["--no-engine.enable_prefix_caching"],
                              gateway_args=["--first_token_from", "prefill"]) as cluster:
                samples = asyncio.run(_ttft_rounds(cluster, args))
        num_blocks = (args.tier_mib << 20) // BLOCK_NBYTES
        bandwidth = _bandwidth_medians(num_blocks, args, work)
    ttft = {name: statistics.median(values) * 1e3 for name, values in samples.items()}
    ratios = {"dram_over_cold": ttft["dram"] / ttft["cold"], "nvme_over_cold": ttft["nvme"] / ttft["cold"],
              "dram_read_over_memcpy": bandwidth["dram_read"] / bandwidth["memcpy"],
              "nvme_write_over_dd": bandwidth["nvme_write"] / bandwidth["dd_direct_write"],
              "nvme_read_over_dd": bandwidth["nvme_read"] / bandwidth["dd_direct_read"]}
    results = {"workload": vars(args), "ttft_ms_median": ttft, "gbps": bandwidth, "ratios": ratios,
               "raw_ttft_s": samples}
    json_path = write_results("kvstore", results, REPORT_DIR)
    png_path = plot_bars("kvstore", [
        (f"TTFT ms, {args.prompt_len} tokens ({args.cached_len} cached)", ttft),
        ("tier GB/s (reads)", {k: bandwidth[k] for k in ("memcpy", "dram_read", "store_read", "nvme_read")}),
        ("disk GB/s", {k: bandwidth[k] for k in ("nvme_write", "dd_direct_write", "nvme_read", "dd_direct_read")})],
        out_dir=REPORT_DIR)
    print(f"TTFT median ({args.prompt_len} tokens): cold {ttft['cold']:.1f} ms | {args.cached_len} cached in DRAM "
          f"{ttft['dram']:.1f} ms ({ratios['dram_over_cold']:.2f}x) | on NVMe {ttft['nvme']:.1f} ms "
          f"({ratios['nvme_over_cold']:.2f}x)")
    print("GB/s: " + ", ".join(f"{k} {v:.2f}" for k, v in bandwidth.items()))
    print("ratios: " + ", ".join(f"{k} {v:.3f}" for k, v in ratios.items()))
    print(f"wrote {json_path} and {png_path}")


if __name__ == "__main__":
    main()

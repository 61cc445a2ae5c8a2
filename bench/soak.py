"""Soak: the fault campaign's mesh (Redis, 2 prefill workers with KV stores, 2 decode, a gateway;
not its fault proxies) under a 64-stream load for 30 minutes, no faults. The workload's prompts
outnumber what the KV stores hold, so blocks are saved, evicted and their index keys dropped all
along. Every process's memory and descriptors, every worker's KV blocks, transfers and pinned
blocks, and Redis's keys are sampled; after a warm-up and at the end, with the load paused, the
two quiet checkpoints must match and every request must have completed with monolithic vLLM's
tokens.

python -m bench.soak [--minutes 30 --streams 64]

Writes bench/report/soak.{json,md,png} (bench/results/ with --scratch).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from bench.common import REPORT_DIR, RESULTS_DIR
from bench.fault_campaign.mesh import FaultMesh, MeshSpec, add_run_arguments, fresh_dir
from bench.fault_campaign.soak import SoakResult, run_soak
from bench.stamp import RunStamp, run_stamp
from bench.fault_campaign.workload import build_workload
from pdmesh.config import DEFAULT_MODEL_DIR
from pdmesh.models.tiny import ensure_llama

# 32 prefixes: ~350 blocks of prompts against ~240 the two stores hold (device + DRAM + NVMe), so
# the stores keep evicting; the NVMe tier's filesystem is larger than the tier (no disk-full here).
NUM_PREFIXES = 32
# The quiet checkpoint the end is compared with comes after this many requests: the gateway's memory
# rises ~7% over its first requests, then stays flat (bench/bench_gateway_memory.py; REPORT, Soak).
WARMUP_REQUESTS = 3_000
SOAK_STORE_ARGS = ["--store.device_bytes", str(2 << 20), "--store.dram_bytes", str(4 << 20),
                   "--store.nvme_bytes", str(24 << 20), "--no-store.nvme_fsync"]


def soak_spec(model_dir: Path, run_dir: Path) -> MeshSpec:
    """The campaign's mesh with the workers' default timeouts (the campaign shortens them so that a
    stopped peer is given up on within its trial), its processes talking to each other directly (no
    fault proxies: nothing is injected, and the load's own process should not carry the mesh's traffic),
    KV over gRPC as in every soak run so far (the report's runs compare)."""
    return MeshSpec(model_dir, run_dir, kv_transport="grpc", hold_timeout_s=60.0, pull_timeout_s=30.0,
                    request_timeout_s=300.0, nvme_fs_bytes=48 << 20, store_args=SOAK_STORE_ARGS, fault_proxies=False)


async def soak(spec: MeshSpec, seconds: float, num_streams: int, sample_every_s: float) -> SoakResult:
    workload = build_workload(spec.model_dir, fresh_dir(spec.run_dir / "reference"), num_prefixes=NUM_PREFIXES)
    with FaultMesh(spec) as mesh:
        return await run_soak(mesh, workload, seconds, num_streams, sample_every_s=sample_every_s,
                              warmup_requests=WARMUP_REQUESTS)


def headline(num_requests: int, seconds: float, num_streams: int, num_warmup_requests: int, warmup_s: float,
             outcomes: dict[str, int]) -> str:
    return (f"{num_requests - num_warmup_requests} requests in {seconds / 60:.0f} min on {num_streams} streams, "
            f"after a warm-up of {num_warmup_requests} requests ({warmup_s / 60:.1f} min); outcomes of all "
            f"{num_requests}: {outcomes}")


def markdown(result: SoakResult) -> str:
    lines = [headline(result.requests, result.seconds, result.num_streams, result.start.num_requests_ended,
                      result.start.at_s, result.outcomes), "", "| check | passed | start -> end |", "|---|---|---|"]
    lines += [f"| {c.name} | {'yes' if c.passed else 'NO'} | {c.detail} |" for c in result.checks]
    lines += ["", f"Longest stretch with requests in flight and none ending: {result.longest_silence_s:.1f} s "
              f"from {result.longest_silence_from}."]
    if result.failures:
        lines += ["", "| request id | outcome | detail | ended at |", "|---|---|---|---|"]
        lines += [f"| {f.request_id} | {f.outcome} | {f.detail} | {f.ended_at} |" for f in result.failures]
    return "\n".join(lines) + "\n"


def plot(result: SoakResult, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    minutes = [s.at_s / 60 for s in result.samples]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    for name in result.start.processes:
        axes[0][0].plot(minutes, [s.processes[name].pss_bytes / 2**20 if name in s.processes else math.nan
                                  for s in result.samples], label=name)
        axes[0][1].plot(minutes, [s.processes[name].num_fds if name in s.processes else math.nan
                                  for s in result.samples], label=name)
    axes[0][0].set_ylabel("PSS of the process group (MiB)")
    axes[0][1].set_ylabel("open file descriptors")
    axes[1][0].plot(minutes, [s.redis_keys for s in result.samples], label="Redis keys")
    axes[1][0].plot(minutes, [s.num_store_blocks for s in result.samples], label="blocks in the stores")
    axes[1][0].set_ylabel("count")
    ended = [s.num_requests_ended for s in result.samples]
    per_minute = [(b - a) / ((t1 - t0) or 1) for a, b, t0, t1 in zip(ended, ended[1:], minutes, minutes[1:])]
    axes[1][1].plot(minutes[1:], per_minute)
    axes[1][1].set_ylabel("requests ended per minute")
    for ax in (a for row in axes for a in row):
        ax.set_xlabel("minutes")
        ax.set_ylim(bottom=0)
    for ax in (axes[0][0], axes[0][1], axes[1][0]):
        ax.legend(fontsize=7)
    fig.suptitle(f"Soak: {result.num_streams} streams, {result.requests} requests")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_report(result: SoakResult, out_dir: Path, settings: dict, stamp: RunStamp) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "soak.json").write_text(json.dumps(
        {"settings": settings, "stamp": asdict(stamp), "result": result.as_json()}, indent=2))
    (out_dir / "soak.md").write_text(f"Run {stamp.run_at} UTC on {stamp.code}, {stamp.machine}.\n\n{markdown(result)}")
    plot(result, out_dir / "soak.png")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--sample-every-s", type=float, default=10.0)
    add_run_arguments(parser)
    args = parser.parse_args()
    started, stamp = time.monotonic(), run_stamp()
    with tempfile.TemporaryDirectory(prefix="pdmesh-soak-") as run_dir:
        spec = soak_spec(ensure_llama(DEFAULT_MODEL_DIR), Path(args.run_dir or run_dir))
        result = asyncio.run(soak(spec, args.minutes * 60, args.streams, args.sample_every_s))
    settings = {**vars(args), "seconds": round(time.monotonic() - started)}
    write_report(result, RESULTS_DIR if args.scratch else REPORT_DIR, settings, stamp)
    print(markdown(result))


if __name__ == "__main__":
    main()

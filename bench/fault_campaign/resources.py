"""What a running mesh holds, sampled during a soak: each process's memory (PSS of its process
group: the worker and its engine's processes) and open file descriptors; each worker's KV blocks in
use, held transfers, pinned and stored blocks; and Redis's keys."""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from pathlib import Path

import grpc

PROC = Path("/proc")


@dataclass(frozen=True)
class ProcessUsage:
    pss_bytes: int       # proportional set size: shared pages split among the processes sharing them
    num_fds: int
    num_processes: int


@dataclass(frozen=True)
class WorkerHolding:
    kv_cache_usage: float      # share of the paged KV cache's blocks in use
    num_running: int
    num_held_transfers: int
    num_pinned_blocks: int     # store blocks being read
    num_store_blocks: int      # blocks the worker's KV store holds, all tiers


@dataclass(frozen=True)
class Sample:
    at_s: float                # since the soak started
    num_requests_ended: int
    processes: dict[str, ProcessUsage]   # process name ("gateway", "prefill-0", ...): its group's usage
    workers: dict[str, WorkerHolding]
    redis_keys: int
    redis_memory_bytes: int

    @property
    def num_store_blocks(self) -> int:
        return sum(worker.num_store_blocks for worker in self.workers.values())


def group_usage(pgid: int) -> ProcessUsage:
    return usage_by_group({pgid})[pgid]


def usage_by_group(pgids: set[int]) -> dict[int, ProcessUsage]:
    """Memory and descriptors of every process in each process group (a LocalCluster process and the
    engine processes it spawned share its group), in one pass over /proc."""
    totals = {pgid: [0, 0, 0] for pgid in pgids}   # PSS bytes, descriptors, processes
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError):   # a process that ended meanwhile
            total = totals.get(_pgid_of(entry))
            if total is None:
                continue
            total[0] += pss_bytes(entry)
            total[1] += len(os.listdir(entry / "fd"))
            total[2] += 1
    return {pgid: ProcessUsage(*total) for pgid, total in totals.items()}


def _pgid_of(proc_dir: Path) -> int:
    stat = (proc_dir / "stat").read_text()
    return int(stat[stat.rindex(")") + 2:].split()[2])   # fields after "(comm)": state, ppid, pgrp


def pss_bytes(proc_dir: Path) -> int:
    for line in (proc_dir / "smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) * 1024
    return 0


def worker_holding(stats) -> WorkerHolding:
    return WorkerHolding(stats.kv_cache_usage, stats.num_running_requests, stats.num_held_transfers,
                         stats.kv_store_pinned_blocks, stats.kv_store_blocks)


def take_sample(mesh, started_s: float, num_requests_ended: int) -> Sample:
    """One sample of every process of `mesh` (a FaultMesh) and of its Redis."""
    pids = mesh.cluster.pids()   # each leads its process group
    usage = usage_by_group(set(pids.values()))
    processes = {name: usage[pid] for name, pid in pids.items()}
    workers = {}
    for name in mesh.prefill_names + mesh.decode_names:
        with contextlib.suppress(grpc.RpcError):
            workers[name] = worker_holding(mesh.stats(name))
    with mesh.redis.client() as redis:
        return Sample(time.monotonic() - started_s, num_requests_ended, processes, workers, redis.dbsize(),
                      redis.info("memory")["used_memory"])

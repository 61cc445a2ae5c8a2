"""A soak: the mesh under a steady stream load for a long while, sampled every few seconds. At a
quiet checkpoint after the warm-up and again at the end (load paused, tail work settled) the mesh
must hold what it held before: memory and descriptors of every process, KV blocks, transfers,
pinned blocks, Redis keys; and no request may be lost."""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import asdict, dataclass, field

from bench.fault_campaign.load import Workload
from bench.fault_campaign.mesh import FaultMesh
from bench.fault_campaign.outcomes import (Outcome, RequestResult, cross_tenant_hits, longest_silence, not_completed,
                                           tally)
from bench.fault_campaign.resources import Sample, take_sample
from bench.fault_campaign.stall_dumps import dump_stalls

MEMORY_TOLERANCE = 0.05    # a process's PSS may end this much above the checkpoint after warm-up
FD_SLACK = 4               # descriptors a process may hold beyond it (sockets being redialled)
MAX_FAILURES_LISTED = 20   # requests not completed listed with their ids


@dataclass(frozen=True)
class Check:
    name: str
    passed: bool
    detail: str


@dataclass(frozen=True)
class Failure:
    """A request that did not complete, as the logs of the mesh's processes can find it."""
    request_id: str
    outcome: str
    detail: str
    ended_at: str              # wall clock, as the processes' logs print it


@dataclass
class SoakResult:
    seconds: float
    num_streams: int
    requests: int = 0
    outcomes: dict[str, int] = field(default_factory=dict)
    not_completed: dict[str, int] = field(default_factory=dict)
    start: Sample | None = None          # the quiet checkpoint after the warm-up
    end: Sample | None = None            # the quiet checkpoint at the end
    samples: list[Sample] = field(default_factory=list)   # under load
    leaks: list[str] = field(default_factory=list)
    probes_judged: int = 0       # tenant B's probe requests that completed in one try (load.py)
    cross_tenant_hits: int = 0   # of those, how many reused cached tokens: tenant A's KV
    failures: list[Failure] = field(default_factory=list)   # the first few requests not completed
    longest_silence_s: float = 0.0   # requests in flight, none ending: a stall of the mesh or the machine
    longest_silence_from: str = ""   # when it began (wall clock, as the logs print it)

    @property
    def checks(self) -> list[Check]:
        return [self._nothing_lost(), *self._flat_processes(), self._nothing_held(), self._redis_bounded(),
                self._tenants_apart()]

    @property
    def passed(self) -> bool:
        return all(check.passed for check in self.checks)

    def as_json(self) -> dict:
        return {**asdict(self), "checks": [asdict(c) for c in self.checks], "passed": self.passed}

    def _nothing_lost(self) -> Check:
        completed = self.outcomes.get(Outcome.COMPLETED.value, 0)
        return Check("no request lost", self.requests > 0 and completed == self.requests,
                     f"{completed} of {self.requests} completed with monolithic vLLM's tokens")

    def _flat_processes(self) -> list[Check]:
        checks = []
        for name, before in self.start.processes.items():
            after = self.end.processes.get(name)
            if after is None:
                checks.append(Check(f"{name} still running", False, "gone at the end"))
                continue
            growth = after.pss_bytes / before.pss_bytes - 1
            checks.append(Check(f"{name} memory flat", growth <= MEMORY_TOLERANCE,
                                f"PSS {before.pss_bytes >> 20} -> {after.pss_bytes >> 20} MiB ({growth:+.1%})"))
            checks.append(Check(f"{name} descriptors flat", after.num_fds <= before.num_fds + FD_SLACK,
                                f"{before.num_fds} -> {after.num_fds} open files"))
        return checks

    def _nothing_held(self) -> Check:
        return Check("no KV block, transfer or pinned block held", not self.leaks, "; ".join(self.leaks) or "none")

    def _tenants_apart(self) -> Check:
        return Check("no tenant reused another's KV", self.probes_judged > 0 and not self.cross_tenant_hits,
                     f"{self.cross_tenant_hits} of {self.probes_judged} tenant-B probes reused cached tokens")

    def _redis_bounded(self) -> Check:
        """Every Redis key is a stored block's index entry: keys of evicted blocks must go with them."""
        keys, blocks = self.end.redis_keys, self.end.num_store_blocks
        return Check("Redis keys bounded by the stored blocks", keys <= blocks,
                     f"{self.start.redis_keys} -> {keys} keys; the stores hold {blocks} blocks")


async def run_soak(mesh: FaultMesh, workload: Workload, seconds: float, num_streams: int = 64,
                   warmup_s: float = 30.0, sample_every_s: float = 10.0, warmup_requests: int = 0) -> SoakResult:
    """`seconds` of load after a warm-up of at least `warmup_s` and `warmup_requests` ended requests
    (the latter given up on after `seconds`: a mesh that slow fails its checks anyway)."""
    result = SoakResult(seconds, num_streams)
    started = time.monotonic()
    async with mesh.stream_load(workload, num_streams) as load:
        await asyncio.sleep(warmup_s)
        await _until_ended(load.results, warmup_requests, time.monotonic() + seconds)
        await load.pause()
        result.start, _ = await asyncio.to_thread(_quiet_sample, mesh, started, len(load.results))
        load.resume()
        dumps = asyncio.create_task(dump_stalls(load, lambda: {**mesh.cluster.pids(), "soak": os.getpid()},
                                                mesh.cluster.run_dir / "stalls"))
        until = time.monotonic() + seconds
        while time.monotonic() < until:
            await asyncio.sleep(min(sample_every_s, max(0.0, until - time.monotonic())))
            result.samples.append(await asyncio.to_thread(take_sample, mesh, started, len(load.results)))
        await load.pause()   # the load stops with the requests in flight ended
        dumps.cancel()
    result.end, result.leaks = await asyncio.to_thread(_quiet_sample, mesh, started, len(load.results))
    result.requests = len(load.results)
    result.outcomes = tally(load.results)
    result.not_completed = not_completed(load.results)
    result.probes_judged, result.cross_tenant_hits = cross_tenant_hits(load.results)
    result.failures = [_failure(r) for r in load.results if r.outcome != Outcome.COMPLETED][:MAX_FAILURES_LISTED]
    silence_s, silence_from = longest_silence(load.results)
    result.longest_silence_s, result.longest_silence_from = round(silence_s, 1), _wall_clock(silence_from)
    return result


async def _until_ended(results: list[RequestResult], num_requests: int, deadline: float) -> None:
    while len(results) < num_requests and time.monotonic() < deadline:
        await asyncio.sleep(1.0)


def _failure(result: RequestResult) -> Failure:
    return Failure(result.request_id, result.outcome.value, result.detail, _wall_clock(result.ended_s))


def _wall_clock(monotonic_s: float) -> str:
    wall_s = time.time() - (time.monotonic() - monotonic_s)
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(wall_s)) + f",{int(wall_s % 1 * 1000):03d}"


def _quiet_sample(mesh: FaultMesh, started: float, num_requests_ended: int) -> tuple[Sample, list[str]]:
    """A sample once no worker holds anything (the load paused, tail work such as store saves settled),
    and what some worker still held when the wait for that ran out."""
    leaks = mesh.leaks()
    return take_sample(mesh, started, num_requests_ended), leaks

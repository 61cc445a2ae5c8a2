"""Runs a fault's trials under a stream load and sums up what became of every request."""

from __future__ import annotations

import asyncio
import datetime
import time
from dataclasses import asdict, dataclass, field, replace

from bench.fault_campaign.faults import Fault, Trial
from bench.fault_campaign.load import Workload
from bench.fault_campaign.mesh import FaultMesh
from bench.fault_campaign.outcomes import GOOD, cross_tenant_hits, not_completed, tally

WARMUP_S = 2.0
PAUSE_S = 1.0          # load between trials
MAX_TRIAL_NOTES = 5


@dataclass
class FaultResult:
    fault: str
    description: str
    trials: int = 0
    trials_hit: int = 0          # trials whose victim was in the state the fault is about
    requests: int = 0
    requests_hit: int = 0        # in flight at an injection
    outcomes: dict[str, int] = field(default_factory=dict)
    leaks: list[str] = field(default_factory=list)
    seconds: float = 0.0
    skipped: str = ""
    not_completed: dict[str, int] = field(default_factory=dict)   # the other outcomes' details: how many each
    trial_notes: list[str] = field(default_factory=list)
    streams: int = 0
    run_at: str = ""             # UTC date and time the fault's trials started (each part's: plus)
    probes_judged: int = 0       # tenant B's probe requests that completed in one try (load.py)
    cross_tenant_hits: int = 0   # of those, how many reused cached tokens: tenant A's KV
    stopped: str = ""            # why the trials ended early ("trial N: ..."): the mesh could not be made whole

    @classmethod
    def from_json(cls, row: dict) -> "FaultResult":
        return cls(**{name: row[name] for name in cls.__dataclass_fields__ if name in row})

    @property
    def good_share(self) -> float:
        """Completed with the monolithic tokens or failed with a clear status."""
        return sum(self.outcomes.get(o.value, 0) for o in GOOD) / self.requests if self.requests else 0.0

    @property
    def meets_goal(self) -> bool:
        return (not self.skipped and not self.stopped and self.requests > 0 and self.good_share == 1.0
                and not self.leaks and not self.cross_tenant_hits)

    def as_json(self) -> dict:
        return {**asdict(self), "good_share": self.good_share, "meets_goal": self.meets_goal}

    def plus(self, later: "FaultResult") -> "FaultResult":
        """This row and a later run's row of the same fault as one (a long campaign run in parts)."""
        if later.skipped or self.skipped:
            return self if later.skipped else later
        if later.fault != self.fault or later.streams != self.streams:
            raise ValueError(f"cannot add {later.fault} on {later.streams} streams to {self.fault} on {self.streams}")
        summed = {name: getattr(self, name) + getattr(later, name)
                  for name in ("trials", "trials_hit", "requests", "requests_hit", "seconds", "probes_judged",
                               "cross_tenant_hits", "leaks")}
        return replace(later, **summed, outcomes=_added(self.outcomes, later.outcomes),
                       not_completed=_added(self.not_completed, later.not_completed),
                       trial_notes=(self.trial_notes + later.trial_notes)[:MAX_TRIAL_NOTES],
                       run_at=f"{self.run_at} + {later.run_at}", stopped=self.stopped or later.stopped)


def _added(counts: dict[str, int], more: dict[str, int]) -> dict[str, int]:
    """Both counts by key (keys counted 0 kept, as tally writes every outcome)."""
    return {key: counts.get(key, 0) + more.get(key, 0) for key in {**counts, **more}}


async def run_fault(mesh: FaultMesh, workload: Workload, fault: Fault, trials: int, num_streams: int = 16) -> FaultResult:
    result = FaultResult(fault.name, fault.description, streams=num_streams,
                         run_at=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"))
    reason = fault.unavailable(mesh)
    if reason is not None:
        result.skipped = reason
        return result
    started = time.monotonic()
    done: list[Trial] = []
    async with mesh.stream_load(workload, num_streams) as load:
        await asyncio.sleep(WARMUP_S)
        for index in range(trials):
            try:
                done.append(await asyncio.to_thread(fault.inject, mesh, index))
                # A worker starting beside spinning engines on the same cores takes minutes (an OpenMP
                # start-up competing with busy-waits): recovery runs with the load paused.
                await load.pause()
                await asyncio.to_thread(fault.recover, mesh, done[-1])
            except Exception as exc:   # the row keeps what ran; the campaign stops (the mesh is broken)
                result.stopped = f"trial {index}: {type(exc).__name__}: {exc}"[:500]
                break
            load.resume()
            await asyncio.sleep(PAUSE_S)
    if not result.stopped:   # a mesh left broken cannot be asked what it holds
        result.leaks = await asyncio.to_thread(mesh.leaks)
    result.seconds = time.monotonic() - started
    result.trials, result.trials_hit = len(done), sum(trial.hit for trial in done)
    result.trial_notes = [f"{t.victim}: {t.note}" for t in done[:MAX_TRIAL_NOTES]]
    result.requests = len(load.results)
    result.requests_hit = sum(any(r.in_flight_at(t.at_s) for t in done) for r in load.results)
    result.outcomes = tally(load.results)
    result.not_completed = not_completed(load.results)
    result.probes_judged, result.cross_tenant_hits = cross_tenant_hits(load.results)
    return result

"""Runs a fault's trials under a stream load (never paused: a killed worker restarts under it) and
sums up what became of every request, of those on each trial's victim (affected.py), and the
outage each trial caused. A row records the commit, machine and time it ran on (stamp.py)."""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import asdict, dataclass, field, replace

from bench.fault_campaign.affected import FaultWindow, Timeline, requests_on_victim, tally_on_victim
from bench.fault_campaign.faults import Fault, Trial
from bench.fault_campaign.load import Workload
from bench.fault_campaign.mesh import FaultMesh
from bench.fault_campaign.outcomes import GOOD, RequestResult, cross_tenant_hits, not_completed, tally
from bench.stamp import RunStamp, run_stamp

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
    outcomes: dict[str, int] = field(default_factory=dict)
    on_victim: dict[str, int] = field(default_factory=dict)   # the requests on a trial's victim, by VictimOutcome
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
    outages_s: list[float] = field(default_factory=list)   # each trial's longest stretch with none completing
    failed_in_outages: int = 0   # requests that ended without completing inside those stretches
    kv_transport: str = ""       # the workers' --kv_transport
    commit: str = ""             # git HEAD it ran on ("": a row from before rows were stamped)
    dirty: str = ""              # "" for a clean tree, else a hash of its diff against HEAD
    machine: str = ""

    @classmethod
    def from_json(cls, row: dict) -> "FaultResult":
        return cls(**{name: row[name] for name in cls.__dataclass_fields__ if name in row})

    @property
    def good_share(self) -> float:
        """Completed with the monolithic tokens or failed with a clear status."""
        return sum(self.outcomes.get(o.value, 0) for o in GOOD) / self.requests if self.requests else 0.0

    @property
    def requests_on_victim(self) -> int:
        return sum(self.on_victim.values())

    @property
    def longest_outage_s(self) -> float:
        return max(self.outages_s, default=0.0)

    @property
    def median_outage_s(self) -> float:
        return statistics.median(self.outages_s) if self.outages_s else 0.0

    @property
    def code(self) -> str:
        """The code the row ran on, as RunStamp.code writes it."""
        return RunStamp(self.commit, self.dirty, self.machine, self.run_at).code

    @property
    def meets_goal(self) -> bool:
        return (not self.skipped and not self.stopped and self.requests > 0 and self.good_share == 1.0
                and not self.leaks and not self.cross_tenant_hits)

    def as_json(self) -> dict:
        return {**asdict(self), "requests_on_victim": self.requests_on_victim, "good_share": self.good_share,
                "meets_goal": self.meets_goal}

    def record_stamp(self, stamp: RunStamp) -> None:
        self.commit, self.dirty, self.machine, self.run_at = stamp.commit, stamp.dirty, stamp.machine, stamp.run_at

    def plus(self, later: "FaultResult") -> "FaultResult":
        """This row and a later run's row of the same fault as one (a long campaign run in parts): only
        parts run on the same code and KV transport add up."""
        if later.skipped or self.skipped:
            return self if later.skipped else later
        if (later.fault, later.streams, later.kv_transport) != (self.fault, self.streams, self.kv_transport):
            raise ValueError(f"cannot add {later.fault} on {later.streams} streams over {later.kv_transport} to "
                             f"{self.fault} on {self.streams} over {self.kv_transport}")
        if later.code != self.code:
            raise ValueError(f"cannot add {later.fault} run on {later.code} to its row run on {self.code}")
        summed = {name: getattr(self, name) + getattr(later, name)
                  for name in ("trials", "trials_hit", "requests", "seconds", "probes_judged",
                               "cross_tenant_hits", "leaks", "outages_s", "failed_in_outages")}
        return replace(later, **summed, outcomes=_added(self.outcomes, later.outcomes),
                       on_victim=_added(self.on_victim, later.on_victim),
                       not_completed=_added(self.not_completed, later.not_completed),
                       trial_notes=(self.trial_notes + later.trial_notes)[:MAX_TRIAL_NOTES],
                       run_at=f"{self.run_at} + {later.run_at}", stopped=self.stopped or later.stopped,
                       machine=self.machine if later.machine == self.machine else f"{self.machine} + {later.machine}")


def _added(counts: dict[str, int], more: dict[str, int]) -> dict[str, int]:
    """Both counts by key (keys counted 0 kept, as tally writes every outcome)."""
    return {key: counts.get(key, 0) + more.get(key, 0) for key in {**counts, **more}}


async def run_fault(mesh: FaultMesh, workload: Workload, fault: Fault, trials: int,
                    num_streams: int = 16) -> FaultResult:
    result = FaultResult(fault.name, fault.description, streams=num_streams, kv_transport=mesh.spec.kv_transport)
    result.record_stamp(run_stamp())   # each row's own: a tree changed between rows shows
    reason = fault.unavailable(mesh)
    if reason is not None:
        result.skipped = reason
        return result
    started = time.monotonic()
    done: list[Trial] = []
    windows: list[FaultWindow] = []
    async with mesh.stream_load(workload, num_streams) as load:
        await asyncio.sleep(WARMUP_S)
        for index in range(trials):
            try:
                done.append(await asyncio.to_thread(fault.inject, mesh, index))
                try:   # under the load: what the mesh serves while a worker restarts is measured
                    await asyncio.to_thread(fault.recover, mesh, done[-1])
                finally:
                    windows.append(fault_window(mesh, fault, done[-1], time.monotonic()))
            except Exception as exc:   # the row keeps what ran; the campaign stops (the mesh is broken)
                result.stopped = f"trial {index}: {type(exc).__name__}: {exc}"[:500]
                break
            await asyncio.sleep(PAUSE_S)
    if not result.stopped:   # a mesh left broken cannot be asked what it holds
        result.leaks = await asyncio.to_thread(mesh.leaks)
    result.seconds = time.monotonic() - started
    result.trials, result.trials_hit = len(done), sum(trial.hit for trial in done)
    result.trial_notes = [f"{t.victim}: {t.note}" for t in done[:MAX_TRIAL_NOTES]]
    count_requests(result, load.results, windows)
    return result


def fault_window(mesh: FaultMesh, fault: Fault, trial: Trial, over_s: float) -> FaultWindow:
    """The trial's window and how its victim's requests are known (affected.py)."""
    if fault.shared_victim:
        return FaultWindow(trial.at_s, over_s, None)
    store_peer = trial.victim in mesh.prefill_names and len(mesh.prefill_names) == 2
    return FaultWindow(trial.at_s, over_s, mesh.addresses_of(trial.victim), reads_victim_store=store_peer)


def count_requests(result: FaultResult, results: list[RequestResult], windows: list[FaultWindow]) -> None:
    """Every request's outcome, those on the trials' victims, and each trial's outage, into the row."""
    result.requests = len(results)
    result.outcomes = tally(results)
    result.not_completed = not_completed(results)
    result.probes_judged, result.cross_tenant_hits = cross_tenant_hits(results)
    result.on_victim = tally_on_victim(requests_on_victim(results, windows))
    timeline = Timeline(results)
    outages = [timeline.longest_outage(window) for window in windows]
    result.outages_s = [round(outage.seconds, 2) for outage in outages]
    result.failed_in_outages = sum(outage.num_failed for outage in outages)

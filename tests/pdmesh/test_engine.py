"""The connector's config as the worker hands it to vLLM: the KV address peers dial is resolved
once (WorkerSettings.kv_address_for_peers), and the connector reads that same address. The
engine processes' environment: tcmalloc preloaded where installed."""

import ctypes.util
import os

import pytest

from pdmesh.config import EngineSettings, WorkerSettings
from pdmesh.connector.connector import _advertised
from pdmesh.engine import apply_cpu_env, kv_transfer_config, preload_tcmalloc

needs_tcmalloc = pytest.mark.skipif(ctypes.util.find_library("tcmalloc_minimal") is None,
                                    reason="libtcmalloc-minimal4 is not installed (scripts/setup.sh installs it)")


def _extra(*flags: str, kv_port: int = 7001) -> dict:
    settings = WorkerSettings.from_cli(["--role", "prefill", "--engine.model", "m", *flags])
    return kv_transfer_config(settings, kv_port)["kv_connector_extra_config"]


def test_peers_dial_where_the_kv_port_binds_by_default():
    extra = _extra("--kv_host", "10.0.0.5")
    assert _advertised(extra, extra["kv_host"], extra["kv_port"]) == ("10.0.0.5", 7001)


def test_an_advertised_host_and_port_replace_the_bound_ones():
    extra = _extra("--kv_host", "0.0.0.0", "--kv_advertise_host", "prefill", "--kv_advertise_port", "9000")
    assert extra["kv_advertise_address"] == "prefill:9000"
    assert _advertised(extra, extra["kv_host"], extra["kv_port"]) == ("prefill", 9000)


@needs_tcmalloc
def test_tcmalloc_goes_first_in_the_engine_processes_preloads_and_only_once():
    environ = {"LD_PRELOAD": "/torch/lib/libgomp.so.1"}
    assert preload_tcmalloc(environ) == "libtcmalloc_minimal.so.4"
    assert environ["LD_PRELOAD"] == "libtcmalloc_minimal.so.4:/torch/lib/libgomp.so.1"
    assert preload_tcmalloc(environ) is None
    assert environ["LD_PRELOAD"] == "libtcmalloc_minimal.so.4:/torch/lib/libgomp.so.1"


@needs_tcmalloc
def test_the_system_allocator_leaves_ld_preload_alone(monkeypatch):
    for name in ("LD_PRELOAD", "VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU"):
        monkeypatch.delenv(name, raising=False)   # restored after the test
    apply_cpu_env(EngineSettings(allocator="system"))
    assert "LD_PRELOAD" not in os.environ
    apply_cpu_env(EngineSettings())
    assert os.environ["LD_PRELOAD"] == "libtcmalloc_minimal.so.4"

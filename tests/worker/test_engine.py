"""The connector's config as the worker hands it to vLLM: the KV address peers dial is resolved
once (WorkerSettings.kv_address_for_peers), and the connector reads that same address. The
environment the engine processes inherit."""

import os

import pytest

from pdmesh.config import ConnectorSettings, WorkerSettings
from worker.engine import apply_cpu_env, engine_kwargs, kv_transfer_config

ENGINE_ENV = ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU",
              "ONEDNN_PRIMITIVE_CACHE_CAPACITY")


def _extra(*flags: str, kv_port: int = 7001) -> ConnectorSettings:
    """The connector's settings as the connector reads them back from vLLM's config."""
    settings = WorkerSettings.from_cli(["--role", "prefill", "--engine.model", "m", *flags])
    return ConnectorSettings.model_validate(kv_transfer_config(settings, kv_port)["kv_connector_extra_config"])


def test_peers_dial_where_the_kv_port_binds_by_default():
    assert _extra("--kv_host", "10.0.0.5").advertised == ("10.0.0.5", 7001)


def test_an_advertised_host_and_port_replace_the_bound_ones():
    extra = _extra("--kv_host", "0.0.0.0", "--kv_advertise_host", "prefill", "--kv_advertise_port", "9000")
    assert (extra.kv_host, extra.kv_port, extra.advertised) == ("0.0.0.0", 7001, ("prefill", 9000))


def test_the_engines_queue_spin_is_the_platforms_unless_set():
    assert _extra().queue_spin_s is None            # the connector picks: 0 on the CPU
    assert _extra("--engine_queue_spin_s", "1").queue_spin_s == 1.0


def test_every_worker_setting_the_connector_reads_reaches_it():
    extra = _extra("--hold_timeout_s", "5", "--pull_timeout_s", "7", "--kv_transport", "grpc", "--mesh_token", "t",
                   "--kv_gil_switch_interval_s", "0.001", "--process_cpus", "1", "--store.dram_bytes", "1024")
    assert (extra.hold_timeout_s, extra.pull_timeout_s, extra.transport.kv_transport, extra.transport.mesh_token,
            extra.gil_switch_interval_s, extra.thread_cpus, extra.store.dram_bytes) == (
        5.0, 7.0, "grpc", "t", 0.001, "1", 1024)
    assert extra.wake_name  # quiet steps on by default: an engine's own socket name


def test_the_cpu_platforms_engines_sleep_on_their_queues():
    from vllm.platforms import current_platform

    from worker.vllm_ext.queue_spin import default_spin_s
    assert current_platform.is_cpu()
    assert default_spin_s() == 0.0


@pytest.fixture
def engine_env(monkeypatch):
    """apply_cpu_env's variables, unset, and restored after the test."""
    for name in ENGINE_ENV:
        monkeypatch.delenv(name, raising=False)


def test_engines_run_without_onednns_global_primitive_cache_by_default(engine_env):
    apply_cpu_env(WorkerSettings.from_cli(["--role", "prefill"]).engine)
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "0"
    assert os.environ["VLLM_CPU_KVCACHE_SPACE"] == "1"


def test_the_onednn_cache_capacity_is_a_setting(engine_env):
    apply_cpu_env(WorkerSettings.from_cli(["--role", "decode", "--engine.onednn_primitive_cache_capacity", "1024"]).engine)
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "1024"


def test_vllms_prefix_cache_names_blocks_by_sha256():
    assert engine_kwargs(WorkerSettings.from_cli(["--role", "prefill"]).engine)["prefix_caching_hash_algo"] == "sha256"

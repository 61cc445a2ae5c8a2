"""Builds a worker's vLLM engine with the PDMesh connector for its role."""

from __future__ import annotations

import os
import socket
from typing import Any

from pdmesh.config import ConnectorSettings, EngineSettings, WorkerSettings
from worker.vllm_ext.quiet_steps import new_wake_name
from worker.vllm_ext.version import check_vllm_version

CONNECTOR_MODULE = "worker.connector"
WORKER_EXTENSION = "worker.vllm_ext.worker_ext.PDMeshWorkerExtension"
KV_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer", "both": "kv_both"}   # a worker's role: vLLM's


def apply_cpu_env(engine: EngineSettings) -> None:
    """vLLM's CPU backend reads these from the environment of the engine processes it spawns."""
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(engine.kv_cache_space_gib)
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = engine.omp_threads_bind
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = str(engine.onednn_primitive_cache_capacity)


def free_port(host: str, count: int = 1) -> int:
    """A free port P such that P .. P + count - 1 are free too (one per tensor-parallel rank)."""
    for _ in range(100):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
            port = sock.getsockname()[1]
        if all(_is_free(host, port + offset) for offset in range(1, count)):
            return port
    raise OSError(f"no {count} consecutive free ports on {host}")


def _is_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def connector_settings(settings: WorkerSettings, kv_port: int, wake_name: str = "") -> ConnectorSettings:
    return ConnectorSettings(
        kv_host=settings.kv_host, kv_port=kv_port,
        kv_advertise_address=settings.kv_address_for_peers(kv_port),   # rank 0's; rank r adds r to the port
        hold_timeout_s=settings.hold_timeout_s, pull_timeout_s=settings.pull_timeout_s,
        transport=settings.kv_transport_settings, gil_switch_interval_s=settings.kv_gil_switch_interval_s,
        wake_name=wake_name, queue_spin_s=settings.engine_queue_spin_s,
        thread_cpus=settings.process_cpus,   # where its layer-wise reads run ("": every core)
        initial_prefill_tokens_per_s=settings.initial_prefill_tokens_per_s,
        store=settings.store if settings.produces else None,
        telemetry=settings.telemetry)   # the engine's worker process sets up its own tracing from this


def kv_transfer_config(settings: WorkerSettings, kv_port: int) -> dict[str, Any]:
    wake_name = new_wake_name() if settings.kv_quiet_steps else ""   # this engine's own
    return {
        "kv_connector": "PDMeshConnector",
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": KV_ROLES[settings.role],
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": connector_settings(settings, kv_port, wake_name).model_dump(mode="json"),
    }


def engine_kwargs(engine: EngineSettings) -> dict[str, Any]:
    chunking = {"max_num_batched_tokens": engine.max_num_batched_tokens} if engine.max_num_batched_tokens else {}
    backend = {"attention_backend": engine.attention_backend} if engine.attention_backend else {}
    return {
        **chunking,
        **backend,
        "model": engine.model,
        "served_model_name": engine.served_model_name,
        "dtype": engine.dtype,
        "block_size": engine.block_size,
        "max_model_len": engine.max_model_len,
        "max_num_seqs": engine.max_num_seqs,
        "enforce_eager": engine.enforce_eager,
        "enable_prefix_caching": engine.enable_prefix_caching,
        # vLLM's own prefix cache names blocks by SHA-256 (its default since CVE-2025-25183), pinned
        # here so that no default change makes it xxhash, as pdmesh's own block names are not
        "prefix_caching_hash_algo": "sha256",
        "seed": engine.seed,
        "tensor_parallel_size": engine.tensor_parallel_size,
    }


def build_worker_engine(settings: WorkerSettings, kv_port: int, stat_loggers: list | None = None):
    """AsyncLLM for a prefill or decode worker (imports vLLM here, not at module import)."""
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    check_vllm_version()
    apply_cpu_env(settings.engine)
    args = AsyncEngineArgs(
        **engine_kwargs(settings.engine),
        kv_transfer_config=KVTransferConfig(**kv_transfer_config(settings, kv_port)),
        worker_extension_cls=WORKER_EXTENSION,
    )
    return AsyncLLM.from_engine_args(args, stat_loggers=stat_loggers)

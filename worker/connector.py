"""PDMeshConnector: vLLM v1 KV connector that moves prefill KV to decode (shared memory, Mooncake or gRPC).

Loaded by vLLM through kv_transfer_config:
  {"kv_connector": "PDMeshConnector", "kv_connector_module_path": "worker.connector",
   "kv_role": "kv_producer" | "kv_consumer",
   "kv_connector_extra_config": ConnectorSettings, as JSON (pdmesh/config.py; worker/engine.py builds it)}
Each role's logic lives in its own class; this class only routes vLLM's calls to them.
"""

from __future__ import annotations

import logging
import sys
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole

from kvstore.store_lookup import AsyncStoreLookup, StoreLookup
from pdmesh.compat import model_fingerprint
from pdmesh.config import ConnectorSettings, StoreSettings
from pdmesh.telemetry.logs import configure_engine_logging
from pdmesh.transport.affinity import all_cores
from worker.compute_rate import ComputeRate, LoadBudget
from worker.step_time import DecodeStepTime
from worker.metadata import PDMeshConnectorMetadata, PDMeshWorkerMeta
from worker.scheduler_side import ConnectorScheduler
from worker.vllm_ext.engine_core_ext import install_scheduler_stats
from worker.vllm_ext.queue_spin import default_spin_s, set_queue_spin
from worker.vllm_ext.quiet_steps import QuietSteps, install_quiet_steps
from worker.worker_side import ConnectorWorker

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


class PDMeshConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig | None" = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        configure_engine_logging()
        settings = ConnectorSettings.model_validate(self._kv_transfer_config.kv_connector_extra_config or {})
        spin_s = settings.queue_spin_s
        set_queue_spin(default_spin_s() if spin_s is None else spin_s)  # this engine process's queues
        block_size = vllm_config.cache_config.block_size
        # what both halves name blocks under: the scheduler side hashes, the worker side's CompatInfo says it
        self._fingerprint = _configured_fingerprint(vllm_config)
        self._scheduler: ConnectorScheduler | None = None
        self._worker: ConnectorWorker | None = None
        self._quiet: QuietSteps | None = None
        store = settings.store
        tp_size = vllm_config.parallel_config.tensor_parallel_size
        if store is not None and store.enabled and tp_size > 1:
            # each rank holds its share of the heads: the store would need one namespace and node per rank
            logger.warning("the KV store is off with tensor parallelism (tp=%d): not supported yet", tp_size)
            store = None
        if role == KVConnectorRole.SCHEDULER:
            install_scheduler_stats()  # this runs in the engine core's process
            self._scheduler = self._make_scheduler(settings, store, block_size, tp_size)
        else:
            if settings.gil_switch_interval_s:  # the KV threads' GIL handoffs (pdmesh/config.py)
                sys.setswitchinterval(settings.gil_switch_interval_s)
            with all_cores():  # the tracer's gRPC exporter starts threads here: keep them off the engine's core
                self._worker = self._make_worker(vllm_config, settings, block_size, store)

    def _make_scheduler(self, settings: ConnectorSettings, store: StoreSettings | None, block_size: int,
                        tp_size: int) -> ConnectorScheduler:
        local_host = "127.0.0.1" if settings.kv_host in ("0.0.0.0", "") else settings.kv_host  # the worker is here
        lookup = (AsyncStoreLookup(StoreLookup(f"{local_host}:{settings.kv_port}", block_size, store.lookup_timeout_s,
                                               settings.transport.auth), max_wait_s=store.lookup_timeout_s)
                  if store is not None and store.enabled and self._kv_transfer_config.is_kv_producer else None)
        if settings.wake_name:  # steps skip the workers while every request waits for KV
            try:
                self._quiet = QuietSteps(settings.wake_name)
                install_quiet_steps()
            except OSError as exc:  # no abstract unix sockets here: every step goes to the workers
                logger.warning("engine steps will not skip the workers while requests wait for KV: %s", exc)
        load_budget = LoadBudget(store.load_budget_factor, store.load_budget_min_s) if store is not None else None
        return ConnectorScheduler(block_size, settings.kv_advertise_address, self._fingerprint.encode(), lookup,
                                  tp_size=tp_size, compute_rate=ComputeRate(settings.initial_prefill_tokens_per_s),
                                  load_budget=load_budget)

    def _make_worker(self, vllm_config, settings: ConnectorSettings, block_size: int,
                     store: StoreSettings | None) -> ConnectorWorker:
        advertise_host, advertise_port = settings.advertised
        return ConnectorWorker(
            model=vllm_config.model_config.model, block_size=block_size,
            is_producer=self._kv_transfer_config.is_kv_producer,
            is_consumer=self._kv_transfer_config.is_kv_consumer, kv_host=settings.kv_host, kv_port=settings.kv_port,
            hold_timeout_s=settings.hold_timeout_s, pull_timeout_s=settings.pull_timeout_s,
            telemetry=settings.telemetry, store=store, kv_advertise_host=advertise_host,
            kv_advertise_port=advertise_port, transport=settings.transport, tp_rank=_tp_rank(),
            wake_name=settings.wake_name, thread_cpus=settings.thread_cpus,
            tp_size=vllm_config.parallel_config.tensor_parallel_size,
            num_kv_heads=vllm_config.model_config.get_num_kv_heads(vllm_config.parallel_config))

    @property
    def worker(self) -> ConnectorWorker:
        assert self._worker is not None, "worker-side call on the scheduler-side connector"
        return self._worker

    # ---- worker side ----
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker.register_kv_caches(kv_caches, self._kv_cache_config.num_blocks)
        if self.worker.compat.model_fingerprint != self._fingerprint:   # the cache is not of the configured dtype
            raise RuntimeError(f"the KV cache holds {self.worker.compat.dtype}, not the configured dtype: the "
                               "scheduler side would name its blocks under another model fingerprint")

    def bind_connector_metadata(self, connector_metadata: PDMeshConnectorMetadata) -> None:
        """Starts the step's tasks here, before its forward: vLLM calls start_load_kv only after the
        forward when no load is synchronous, which would expose a finished prompt's blocks to decode
        (and start pulls and store loads) a whole forward late."""
        super().bind_connector_metadata(connector_metadata)
        self.worker.start_tasks(connector_metadata)

    def handle_preemptions(self, kv_connector_metadata: PDMeshConnectorMetadata) -> None:
        """vLLM calls this before it updates its batch, which may already write newly allocated
        blocks (zeroing them): layer-wise transfers whose blocks were freed end here, first."""
        self.worker.end_freed_transfers(kv_connector_metadata)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        return None  # started in bind_connector_metadata

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads are asynchronous: the request waits in WAITING_FOR_REMOTE_KVS

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        """The layer's KV is in the cache: layer-wise consumers may read it now. Nothing is copied
        here (the producer serves blocks from the paged cache itself)."""
        self.worker.layer_saved(layer_name)

    def wait_for_save(self) -> None:
        self.worker.step_saved()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self.worker.get_finished()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_failed_block_ids()

    def build_connector_worker_meta(self) -> PDMeshWorkerMeta | None:
        return self.worker.take_worker_meta()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.close()
        if self._quiet is not None:
            self._quiet.close()

    # ---- scheduler side ----
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> PDMeshConnectorMetadata:
        return self._scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        self._scheduler.update_connector_output(connector_output.kv_connector_worker_meta)

    def request_finished(self, request: "Request", block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler.request_finished(request, block_ids)

    def quiet_step(self, scheduler: Any) -> bool:
        """This engine step may skip the model workers (worker/vllm_ext/quiet_steps.py)."""
        return self._quiet is not None and self._quiet.skip(scheduler, self._scheduler.has_work_for_workers())

    @property
    def quiet_steps(self) -> QuietSteps | None:
        return self._quiet

    @property
    def compute_rate(self) -> ComputeRate | None:
        """The engine's measured prompt rate (scheduler side only)."""
        return self._scheduler.compute_rate if self._scheduler is not None else None

    @property
    def decode_step_time(self) -> DecodeStepTime | None:
        """The engine's measured decoding step time (scheduler side only)."""
        return self._scheduler.decode_step_time if self._scheduler is not None else None


def _tp_rank() -> int:
    """This worker's tensor-parallel rank (0 outside an initialized vLLM worker)."""
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank()
    except (AssertionError, ImportError, RuntimeError):
        return 0


def _configured_fingerprint(vllm_config: "VllmConfig") -> str:
    """The model fingerprint (pdmesh/compat.py) of the KV cache this configuration allocates: the
    scheduler side, which sees no cache, names blocks under it."""
    from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype

    dtype = kv_cache_dtype_str_to_dtype(vllm_config.cache_config.cache_dtype, vllm_config.model_config)
    return model_fingerprint(vllm_config.model_config.model, str(dtype).removeprefix("torch."),
                             vllm_config.cache_config.block_size)

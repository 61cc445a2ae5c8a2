"""Worker-side half of the connector (runs in the vLLM worker process that owns the KV cache).

It composes, over the engine's paged KV cache:
- a producer (prefill/kv/producer.py): pins the blocks of finished prefills and serves them;
- a consumer (decode/kv/consumer.py): reads blocks from producers into the cache, verified;
- on a producer with a KV store (kvstore/store_agent.py): saves finished prompts' full blocks
  (worker/store_saver.py), loads cached prefixes into the cache, exports blocks to other nodes.
What the engine needs back each step (requests received, blocks that failed, their stats) is
gathered here.
"""

from __future__ import annotations

import logging
import threading

import torch
from opentelemetry import context

from decode.kv.consumer import KVConsumer, kv_readers, mooncake_engine
from decode.kv.kv_links import KVLinks
from decode.kv.kv_port_client import KVPortClient
from decode.kv.peer_tasks import PerPeerExecutor
from decode.kv.transfer_stats import TransferLedger
from kvstore.store_agent import StoreAgent
from pdmesh.compat import model_fingerprint
from pdmesh.config import KVTransportSettings, StoreSettings, TelemetrySettings
from pdmesh.kv.kv_layout import piece_sizes
from pdmesh.kv.request_stats import PullStats, encode_stats
from pdmesh.kv.tasks import RecvTask, StoreLoadTask
from pdmesh.telemetry.tracing import extract_carrier, setup_tracing, shutdown_tracing, tracer
from pdmesh.transport.affinity import all_cores, widen_affinity
from pdmesh.transport.shm import segments
from pdmesh.v1 import common_pb2
from prefill.kv.producer import KVProducer
from worker.fault_injection import fault_hooks
from worker.metadata import PDMeshConnectorMetadata, PDMeshWorkerMeta
from worker.paged_kv import PagedKVCache
from worker.store_saver import StoreSaver
from worker.vllm_ext.quiet_steps import TransferWakeups

logger = logging.getLogger(__name__)
STORE_LOAD_THREADS = 2   # the store's loads read from any node, two at a time
STORE_LOADS = "kv store"  # their queue (they take turns as one peer's)


class ConnectorWorker:
    def __init__(self, *, model: str, block_size: int, is_producer: bool, kv_host: str, kv_port: int,
                 is_consumer: bool | None = None,
                 hold_timeout_s: float, pull_timeout_s: float, telemetry: TelemetrySettings,
                 store: StoreSettings | None = None, kv_advertise_host: str | None = None, kv_advertise_port: int = 0,
                 transport: KVTransportSettings | None = None, tp_rank: int = 0, tp_size: int = 1,
                 num_kv_heads: int = 0, wake_name: str = "", thread_cpus: str = "") -> None:
        is_consumer = not is_producer if is_consumer is None else is_consumer   # kv_both: both
        role = "both" if is_producer and is_consumer else "prefill" if is_producer else "decode"
        self._tracer_provider = setup_tracing(telemetry, f"pdmesh-{role}-engine")
        self._model = model
        self._block_size = block_size
        self._is_producer, self._is_consumer = is_producer, is_consumer
        # Each tensor-parallel rank serves its own KV on kv_port + rank (the handle names rank 0's port):
        # no two ranks share a port.
        self._tp_rank, self._tp_size = tp_rank, tp_size
        self._num_kv_heads = num_kv_heads
        self._kv_host, self._kv_port = kv_host, kv_port + tp_rank if kv_port else 0
        self._kv_advertise_host = kv_advertise_host or kv_host
        self._kv_advertise_port = kv_advertise_port + tp_rank if kv_advertise_port else 0
        self._transport = transport or KVTransportSettings()
        self._faults = fault_hooks(self._transport.kv_faults)   # tests' and the fault campaign's; none in deployments
        self._hold_timeout_s = hold_timeout_s
        self._pull_timeout_s = pull_timeout_s
        self._thread_cpus = thread_cpus
        self._store_settings = store if store is not None and store.enabled and is_producer else None
        self._lock = threading.Lock()
        self._done_recving: set[str] = set()
        self._failed_block_ids: set[int] = set()
        self._stats_pending: dict[str, dict] = {}   # engine request id: its pull or load stats, until reported
        self._stats_reported: dict[str, dict] = {}  # reported received this step: go to the scheduler with it
        self._wakeups = TransferWakeups(wake_name) if wake_name else None  # tells the engine core a transfer ended
        self._layer_index: dict[str, int] = {}       # layer name: its position in the cache (and on the wire)
        self._num_steps = 0
        self.compat: common_pb2.CompatInfo | None = None
        self._paged: PagedKVCache | None = None
        self.producer: KVProducer | None = None
        self.consumer: KVConsumer | None = None
        self.store: StoreAgent | None = None
        self.saver: StoreSaver | None = None
        self._store_loads: PerPeerExecutor | None = None

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], num_blocks: int) -> None:
        with all_cores():  # gRPC's threads start here: keep them off the engine's core
            self._register(kv_caches, num_blocks)

    def _register(self, kv_caches: dict[str, torch.Tensor], num_blocks: int) -> None:
        segments.sweep()  # the shared memory of pdmesh processes that died on this host
        self._paged = PagedKVCache(kv_caches, num_blocks, self._num_kv_heads, self._block_size)
        self._layer_index = {name: index for index, name in enumerate(kv_caches)}
        self.compat = common_pb2.CompatInfo(
            model_fingerprint=model_fingerprint(self._model, self._paged.dtype, self._block_size),
            dtype=self._paged.dtype, block_size=self._block_size, layout=self._paged.layout,
            num_layers=self._paged.num_layers, block_nbytes=self._paged.block_nbytes, tp_size=self._tp_size,
            num_kv_heads=self._num_kv_heads, heads_outer=self._paged.heads_outer)
        if self._is_producer:
            self._serve()
        if self._is_consumer:
            self.consumer = KVConsumer(paged=self._paged, compat=self.compat, block_size=self._block_size,
                                       transport=self._transport, pull_timeout_s=self._pull_timeout_s,
                                       on_received=self._received,
                                       tp_rank=self._tp_rank, tp_size=self._tp_size, thread_cpus=self._thread_cpus,
                                       faults=self._faults)

    def _serve(self) -> None:
        auth = self._transport.auth
        if self._store_settings is not None:
            pieces = [(region.num_parts, region.part_nbytes) for region in self._paged.regions()]
            self.store = StoreAgent(self._store_settings, self.compat, self._paged.device, pieces, auth,
                                    faults=self._faults)
        self.producer = KVProducer(paged=self._paged, compat=self.compat, block_size=self._block_size,
                                   kv_host=self._kv_host, kv_port=self._kv_port,
                                   advertise_host=self._kv_advertise_host, advertise_port=self._kv_advertise_port,
                                   hold_timeout_s=self._hold_timeout_s, transport=self._transport,
                                   mooncake_engine=lambda: mooncake_engine(self._transport, self._pull_timeout_s),
                                   store=self.store, faults=self._faults)
        if self.store is not None:
            self.saver = StoreSaver(self.store, self._paged, self.producer.held, self._store_settings.save_queue_bytes)
            control = KVPortClient(self.compat, self._store_settings.fetch_timeout_s, auth,
                                   piece_sizes(self._paged.regions()))   # the exports' blocks are laid out as the cache's
            readers = kv_readers(self._paged, self._transport, control, self._pull_timeout_s)
            self.store.connect(KVLinks(control, readers, store=True))
            self.store.attach(self.producer.address)
            self._store_loads = PerPeerExecutor(STORE_LOAD_THREADS, STORE_LOAD_THREADS,
                                                thread_name_prefix="pdmesh-kv-load", initializer=widen_affinity)

    def start_tasks(self, meta: PDMeshConnectorMetadata) -> None:
        self._num_steps += 1  # every step the engine core sends here, with or without a forward
        if self.producer is not None:
            self.producer.start_step(meta.layerwise_steps, meta.minted_transfer_ids, meta.unheld_transfer_ids, meta)
            for send in meta.sends:
                written = self.producer.adopt_written(send)
                if self.saver is not None:
                    self.saver.submit(send)
                self.producer.hold(send, written)
        if meta.recvs and self.consumer is None or meta.loads and self._store_loads is None:
            raise RuntimeError(f"reads sent to a worker that cannot do them: {len(meta.recvs)} pulls to a "
                               f"{'consumer' if self.consumer else 'producer'}, {len(meta.loads)} store loads "
                               f"{'with' if self._store_loads else 'without'} a store")
        for recv in meta.recvs:
            self.consumer.submit(recv)
        for load in meta.loads:
            self._store_loads.submit(STORE_LOADS, self._load, load)

    def end_freed_transfers(self, meta: PDMeshConnectorMetadata) -> None:
        """Layer-wise transfers whose request ended unheld or was preempted (vLLM calls this before
        its batch update, which may write the freed blocks)."""
        if self.producer is not None:
            self.producer.end_freed_transfers(meta)

    def layer_saved(self, layer_name: str) -> None:
        """vLLM launched (on the CPU: wrote) this step's KV of a layer (engine thread: a dict lookup)."""
        if self.producer is not None:
            self.producer.layer_saved(self._layer_index[layer_name])

    def step_saved(self) -> None:
        if self.producer is not None:
            self.producer.step_saved()

    def release_request(self, request_id: str) -> int:
        """Frees the KV a cancelled prefill request holds (or will hold once the engine registers it)."""
        if self.producer is None:
            return 0
        self.producer.progress.end_request(request_id)  # layer-wise readers stop
        return self.producer.held.release_request(request_id)

    def release_transfer(self, transfer_id: str) -> bool:
        """Frees a transfer no consumer will read."""
        if self.producer is None:
            return False
        self.producer.progress.end(transfer_id)
        return self.producer.held.release(transfer_id)

    def spill_store(self, tier: str) -> int | None:
        """Blocks moved down into `tier`; None without a store or such a tier."""
        return self.store.spill(tier) if self.store is not None else None

    def get_finished(self) -> tuple[set[str] | None, set[str] | None]:
        finished_sending = self.producer.held.take_finished() if self.producer is not None else set()
        with self._lock:
            finished_recving, self._done_recving = self._done_recving, set()
            self._stats_reported, self._stats_pending = self._stats_pending, {}
        return finished_sending or None, finished_recving or None

    def take_worker_meta(self) -> PDMeshWorkerMeta | None:
        """The stats of the requests get_finished just reported received (same step, same output)."""
        stats, self._stats_reported = self._stats_reported, {}
        return PDMeshWorkerMeta(stats) if stats else None

    def take_failed_block_ids(self) -> set[int]:
        with self._lock:
            failed, self._failed_block_ids = self._failed_block_ids, set()
        return failed

    def counters(self) -> dict:
        total = self.consumer.ledger.total() if self.consumer is not None else TransferLedger().total()
        saver = self.saver
        sent = self.producer.counters() if self.producer is not None else {
            "kv_blocks_sent": 0, "kv_bytes_sent": 0, "kv_bytes_sent_by_transport": {},
            "num_held_transfers": 0, "num_expired_transfers": 0}
        return (self.store.counters() if self.store else {}) | ({
            "kv_store_saves_skipped": saver.num_skipped, "kv_store_blocks_skipped": saver.num_skipped_blocks,
            "kv_store_saves_pending": saver.num_pending,
        } if saver else {}) | {
            "kv_blocks_received": total["num_blocks"], "kv_bytes_received": total["num_bytes"],
            "kv_failed_blocks": total["num_failed_blocks"],
            "engine_worker_steps": self._num_steps,
        } | sent

    def shutdown(self) -> None:
        if self.consumer is not None:
            self.consumer.close()
        if self._store_loads is not None:
            self._store_loads.shutdown(wait=True, cancel_futures=True)
        if self.saver is not None:
            self.saver.shutdown()
        if self.producer is not None:
            self.producer.close()
        if self.store is not None:
            self.store.close()
        if self._wakeups is not None:
            self._wakeups.close()
        shutdown_tracing(self._tracer_provider)

    def _received(self, task: RecvTask, stats: PullStats) -> None:
        """A consumer's read ended: its failed blocks go back to vLLM, and the request is reported."""
        self._finished_reading(task.request_id, task.local_block_ids, stats, task.report_done)

    def _load(self, task: StoreLoadTask) -> None:
        token = context.attach(extract_carrier(task.trace_carrier))
        try:
            with tracer().start_as_current_span("kvstore.load") as span:
                stats = self.store.load(task, self._paged.write_blocks, task.budget_s)   # the scheduler side's
                span.set_attributes({"pdmesh.kvstore.budget_s": task.budget_s, "pdmesh.kvstore.cut": stats.cut,
                    **{f"pdmesh.kvstore.tokens.{tier}": n for tier, n in stats.tokens_by_tier.items()},
                    "pdmesh.kvstore.blocks": stats.num_blocks, "pdmesh.kvstore.failed_blocks": stats.num_failed_blocks,
                    "pdmesh.kv.bytes": stats.num_bytes, "pdmesh.kv.duration_s": stats.seconds,
                    "pdmesh.kv.transport": stats.transport})
        finally:
            context.detach(token)
        self._finished_reading(task.request_id, task.local_block_ids, stats, report_done=True)

    def _finished_reading(self, request_id: str, local_block_ids: list[int], stats, report_done: bool) -> None:
        """The blocks past the first stats.num_blocks failed (vLLM recomputes them); a reported
        request is done receiving, with its stats for the scheduler side."""
        with self._lock:
            self._failed_block_ids.update(local_block_ids[stats.num_blocks:])
            if report_done:
                self._done_recving.add(request_id)
                self._stats_pending[request_id] = encode_stats(stats)
        if report_done:
            self._transfer_finished()

    def _transfer_finished(self) -> None:
        """A pull or load is in _done_recving: the engine core steps its workers to learn it."""
        if self._wakeups is not None:
            self._wakeups.transfer_finished()

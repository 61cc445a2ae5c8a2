"""Worker-side half of the connector (runs in the vLLM worker process that owns the KV cache).

Producer: pins blocks named by SendTasks and serves them on its KV port (the control path of every
transport, and the gRPC transport's data); offers its KV cache in place to the registered-memory
transports (shared memory, Mooncake). With a KV store, also saves their full blocks to the store
(the pin lasts until the save is done), loads StoreLoadTasks' blocks from it (other nodes' through
their exports, read with the same transports) and exports its blocks to other nodes.
Consumer: reads blocks named by RecvTasks on a thread pool through the transport agreed with that
producer (pdmesh/transport/kv_transport.py), each verified (content hash, checksum of the landed
bytes), releases them on the producer, and reports the request as received (with any failed block
ids, which vLLM then recomputes).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict

import numpy as np
import torch
from opentelemetry import context

from decode.kv.grpc_kv_reader import GrpcKVReader
from decode.kv.grpc_kv_receiver import GrpcKVReceiver, wait_briefly
from decode.kv.kv_links import KVLinks
from decode.kv.layerwise_read import LayerwiseTarget, LayerwiseTiming, read_layerwise
from decode.kv.mooncake_reader import MooncakeKVReader
from decode.kv.peer_tasks import PerPeerExecutor
from decode.kv.shm_reader import ShmKVReader
from kvstore.store_agent import StoreAgent
from pdmesh.compat import fingerprint_seed, model_fingerprint, tp_ratio
from pdmesh.config import KVTransportSettings, StoreSettings, TelemetrySettings
from pdmesh.errors import BlockHashMismatch, ChecksumMismatch, Incompatible
from pdmesh.kv.block_hash import chain_block_hashes
from pdmesh.kv.tasks import LayerwiseStep, RecvTask, SendTask, StoreLoadTask
from pdmesh.telemetry.tracing import extract_carrier, setup_tracing, shutdown_tracing, tracer
from pdmesh.transport.affinity import all_cores, parse_cpus, widen_affinity
from pdmesh.transport.kv_transport import GRPC, MOONCAKE, SHM, ReadOptions
from pdmesh.transport.mooncake.engine import MooncakeEngine, mooncake_available, shared_engine
from pdmesh.transport.shm import segments
from pdmesh.v1 import common_pb2
from prefill.kv.device_progress import DeviceOrderedProgress, ordered_progress
from prefill.kv.grpc_kv_server import GrpcKVServer, KVTransferServicer
from prefill.kv.held_transfers import HeldTransfer, HeldTransfers
from prefill.kv.layer_progress import LayerProgress
from prefill.kv.mooncake_exporter import MooncakeKVExporter
from prefill.kv.shm_exporter import ShmKVExporter
from worker.compute_rate import ComputeRate
from worker.metadata import PDMeshConnectorMetadata, PDMeshWorkerMeta
from worker.paged_kv import WHOLE, PagedKVCache
from worker.store_saver import StoreSaver
from worker.transfer_stats import TransferLedger, TransferStats
from worker.vllm_ext.quiet_steps import TransferWakeups

logger = logging.getLogger(__name__)
MAX_LAYERWISE_READS = 64
# Pulls (and a producer's store loads) run on a few threads, at most 2 per producer (as many as every
# pull had before): a producer that stops answering holds its 2 until their reads time out, not all.
TRANSFER_THREADS, TRANSFER_THREADS_PER_PEER = 8, 2
STORE_LOADS = "kv store"  # the store's loads take turns as one peer's (they read from any node)


class ConnectorWorker:
    def __init__(self, *, model: str, block_size: int, is_producer: bool, kv_host: str, kv_port: int,
                 hold_timeout_s: float, pull_timeout_s: float, telemetry: TelemetrySettings,
                 store: StoreSettings | None = None, kv_advertise_host: str | None = None, kv_advertise_port: int = 0,
                 transport: KVTransportSettings | None = None, tp_rank: int = 0, tp_size: int = 1,
                 num_kv_heads: int = 0, wake_name: str = "", thread_cpus: str = "") -> None:
        role = "prefill" if is_producer else "decode"
        self._tracer_provider = setup_tracing(telemetry, f"pdmesh-{role}-engine")
        self._model = model
        self._block_size = block_size
        self._is_producer = is_producer
        # Each tensor-parallel rank serves its own KV on kv_port + rank (the handle names rank 0's port):
        # no two ranks share a port. A consumer rank reads the producer ranks holding its heads: the
        # same rank when both have as many ranks; k ranks' head shares when the producer has k times as many.
        self._tp_rank, self._tp_size = tp_rank, tp_size
        self._num_kv_heads = num_kv_heads
        self._kv_host, self._kv_port = kv_host, kv_port + tp_rank if kv_port else 0
        self._kv_advertise_host = kv_advertise_host or kv_host
        self._kv_advertise_port = kv_advertise_port + tp_rank if kv_advertise_port else 0
        self._transport = transport or KVTransportSettings()
        self._store_settings = store if store is not None and store.enabled and is_producer else None
        self.store: StoreAgent | None = None
        self._hold_timeout_s = hold_timeout_s
        self._pull_timeout_s = pull_timeout_s
        self._lock = threading.Lock()
        self._done_recving: set[str] = set()
        self._wakeups = TransferWakeups(wake_name) if wake_name else None  # tells the engine core a transfer ended
        self._stats_pending: dict[str, dict] = {}   # engine request id: its pull or load stats, until reported
        self._stats_reported: dict[str, dict] = {}  # reported received this step: go to the scheduler with it
        # The store's loads are budgeted by it; without a store nothing reads it, so it is not kept.
        self.compute_rate = (ComputeRate(self._store_settings.initial_compute_tokens_per_s)
                             if self._store_settings is not None else None)
        self._failed_block_ids: set[int] = set()
        self.held = HeldTransfers()
        self.progress: LayerProgress | None = None  # producer: transfers read layer by layer while prefilled
        # where the engine thread reports that progress (through the device's events on an accelerator)
        self._progress_reports: LayerProgress | DeviceOrderedProgress | None = None
        self._layer_index: dict[str, int] = {}       # layer name: its position in the cache (and on the wire)
        self._slow_step = False                      # fault tests: this step is slowed (KVFaultSettings)
        self._completing: list[LayerwiseStep] = []   # this step completes these layer-wise prompts
        self._ends_applied_for: PDMeshConnectorMetadata | None = None  # the step whose ends were applied
        self._num_steps = 0
        self.ledger = TransferLedger()
        self.compat: common_pb2.CompatInfo | None = None
        self._paged: PagedKVCache | None = None
        self._server: GrpcKVServer | None = None
        self._servicer: KVTransferServicer | None = None
        self._exporters: list = []
        self._store_exporters: list = []
        self._links: dict[tuple[int, int], KVLinks] = {}  # by head slice (j, k) of the local cache they fill
        self._pool = PerPeerExecutor(TRANSFER_THREADS, TRANSFER_THREADS_PER_PEER, thread_name_prefix="pdmesh-kv-recv",
                                     initializer=widen_affinity)
        # Layer-wise reads mostly wait for the producer's next layer: one thread each, up to this many
        # at once (a read queued behind them starts late and hides less of its transfer). They run while
        # the producer computes, so they stay on this worker's cores (--process_cpus; every core when
        # unset): widened like the pulls', they took prefill's core on a shared host, and prefill's
        # calls took 4-47% longer (bench/REPORT.md, layer-wise flow, run 1).
        self._layerwise_pool = ThreadPoolExecutor(max_workers=MAX_LAYERWISE_READS, thread_name_prefix="pdmesh-kv-lw",
                                                  initializer=functools.partial(widen_affinity,
                                                                                parse_cpus(thread_cpus)))
        # Producer: checksums of newly held blocks for the registered-memory transports, off the engine thread.
        self._checksum_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pdmesh-kv-sum",
                                                 initializer=widen_affinity)
        self.saver: StoreSaver | None = None

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
        else:
            self._links_for(WHOLE)

    def _serve(self) -> None:
        auth = self._transport.auth
        num_layers = self._paged.num_layers
        self.progress = LayerProgress(num_layers, self.held,
                                      layer_bytes_per_token=self._paged.block_nbytes // (num_layers * self._block_size),
                                      min_read_bytes=self._transport.layerwise_read_bytes)
        self._progress_reports = ordered_progress(self.progress, self._paged.device)
        if self._store_settings is not None:
            pieces = [(region.num_parts, region.part_nbytes) for region in self._paged.regions()]
            self.store = StoreAgent(self._store_settings, self.compat, self._paged.device, pieces, auth,
                                    rot_tiers=self._transport.kv_faults.rot_store_tiers)
            self.saver = StoreSaver(self.store, self._paged, self.held, self._store_settings.save_queue_bytes)
        self._exporters = self._make_exporters()
        self._store_exporters = self._make_store_exporters() if self.store else []
        self._servicer = KVTransferServicer(self.compat, self.held,
                                            lambda block_ids: self._paged.read_blocks(block_ids).numpy(),
                                            exporters=self._exporters, block_checksums=self._paged.block_checksums,
                                            serve_grpc=self._transport.allows(GRPC),
                                            read_run=self._paged.read_bytes,
                                            store=self.store.exports if self.store else None,
                                            store_exporters=self._store_exporters, progress=self.progress,
                                            read_layers=lambda ids, layers: self._paged.read_blocks(ids, layers).numpy())
        self._server = GrpcKVServer(self._servicer, self._kv_host, self._kv_port,
                                    extra_services=[self.store.extra_service()] if self.store else [],
                                    auth=auth)
        if self.store is not None:
            control = GrpcKVReceiver(self.compat, self._store_settings.fetch_timeout_s, auth)
            self.store.connect(KVLinks(control, self._readers(control), store=True))
            port = self._kv_advertise_port or int(self._server.address.rsplit(":", 1)[1])
            self.store.attach(f"{self._kv_advertise_host}:{port}")
        logger.info("pdmesh KV server on %s%s, transports %s", self._server.address,
                    " (with KV store)" if self.store else "",
                    [e.transport for e in self._exporters] + ([GRPC] if self._transport.allows(GRPC) else []))

    def _make_exporters(self) -> list:
        """The registered-memory transports this producer offers, best first. The shared-memory move
        comes first: it changes the cache's addresses, which Mooncake then registers."""
        exporters = []
        if self._transport.allows(SHM) and self._paged.in_place:
            try:
                exporters.append(ShmKVExporter(self._paged.share_memory()))
            except OSError as exc:
                logger.warning("KV cache not offered over shared memory: %s", exc)
        if self._transport.allows(MOONCAKE) and self._paged.in_place and mooncake_available():
            exporters.append(MooncakeKVExporter(self._mooncake_engine(), self._paged.regions()))
        if self._transport.kv_transport not in ("auto", GRPC) and not exporters:
            raise RuntimeError(f"kv_transport={self._transport.kv_transport} is not available in this process")
        return exporters

    def _make_store_exporters(self) -> list:
        """The registered-memory transports other nodes read this node's store exports with (its
        export slab is host memory, on every device)."""
        exports, exporters = self.store.exports, []
        shared = exports.shared_regions()
        if self._transport.allows(SHM) and shared is not None:
            exporters.append(ShmKVExporter(shared))
        if self._transport.allows(MOONCAKE) and mooncake_available():
            exporters.append(MooncakeKVExporter(self._mooncake_engine(), exports.regions(),
                                                registered=[exports.registered_region()]))
        return exporters

    def _links_for(self, head_slice: tuple[int, int]) -> KVLinks:
        """This consumer's links to producers whose blocks fill `head_slice` of its cache."""
        with self._lock:
            links = self._links.get(head_slice)
            if links is None:
                control = GrpcKVReceiver(self.compat, self._pull_timeout_s, self._transport.auth)
                links = self._links[head_slice] = KVLinks(control, self._readers(control, head_slice))
            return links

    def _readers(self, control: GrpcKVReceiver, head_slice: tuple[int, int] = WHOLE) -> list:
        """The transports this consumer reads with, in order of preference, landing blocks in
        `head_slice` of each piece (WHOLE: the whole block)."""
        paged = self._paged
        readers = []
        if paged.in_place and (self._transport.allows(SHM) or self._transport.allows(MOONCAKE)):
            regions = paged.slice_regions(head_slice) if head_slice != WHOLE else paged.regions()
            views = paged.views(regions)
        if paged.in_place and self._transport.allows(SHM):
            readers.append(ShmKVReader(control, regions, views))
        if paged.in_place and self._transport.allows(MOONCAKE) and mooncake_available():
            readers.append(MooncakeKVReader(self._mooncake_engine(), control, regions, views))
        if self._transport.allows(GRPC):
            pieces = [(region.num_parts, region.part_nbytes // head_slice[1]) for region in paged.regions()]
            readers.append(GrpcKVReader(control, lambda ids, rows, layers=None: paged.write_blocks(
                ids, torch.from_numpy(rows), head_slice, layers), pieces))
        if not readers:
            raise RuntimeError(f"kv_transport={self._transport.kv_transport} is not available in this process")
        return readers

    def _mooncake_engine(self) -> MooncakeEngine:
        transport = self._transport
        return shared_engine(transport.mooncake_host, transport.mooncake_protocol, transport.mooncake_device,
                             self._pull_timeout_s)

    def start_tasks(self, meta: PDMeshConnectorMetadata) -> None:
        self._num_steps += 1  # every step the engine core sends here, with or without a forward
        if self.compute_rate is not None:
            self.compute_rate.on_step(meta.num_scheduled_tokens)
        self._track_layerwise(meta)
        self.held.announce(meta.minted_transfer_ids)  # a read of one waits for its hold; of any other id, not
        self.held.drop_announced(meta.unheld_transfer_ids)
        for send in meta.sends:
            written = self._written(send)  # a layer-wise prompt's hashes and checksums, already computed
            send.block_hashes = (list(written.block_hashes) if written is not None
                                 else self._block_hashes(send.token_ids, send.extra_key))
            if self.saver is not None:
                self.saver.submit(send)
            self._hold(send, written.checksums if written is not None else None)
            if self._progress_reports is not None:
                self._progress_reports.held(send.transfer_id)  # after the hold: a Watch sees one or the other
        for recv in meta.recvs:
            if recv.layerwise:
                self._layerwise_pool.submit(self._receive, recv)
            else:
                self._pool.submit(recv.kv_address, self._receive, recv)
        for load in meta.loads:
            self._pool.submit(STORE_LOADS, self._load, load)

    def end_freed_transfers(self, meta: PDMeshConnectorMetadata) -> None:
        """Layer-wise transfers whose request ended unheld or was preempted: their blocks are freed, and
        nothing read or computed of them from here on is published (before vLLM's batch update,
        which may write the blocks; start_tasks does it when vLLM does not call this)."""
        reports = self._progress_reports
        if reports is None or meta is self._ends_applied_for:
            return
        self._ends_applied_for = meta
        for transfer_id in meta.layerwise_ended:
            reports.end(transfer_id)
        for transfer_id in meta.layerwise_restarted:
            reports.restart(transfer_id)

    def _track_layerwise(self, meta: PDMeshConnectorMetadata) -> None:
        reports = self._progress_reports
        if reports is None:
            return
        slow = self._transport.kv_faults.slow_prefill_request_prefix
        self._slow_step = bool(slow) and any(step.pdmesh_request_id.startswith(slow) for step in meta.layerwise_steps)
        self.end_freed_transfers(meta)
        for step in meta.layerwise_steps:
            reports.start_step(step.transfer_id, step.pdmesh_request_id, step.block_ids,
                               step.num_tokens_before, step.num_tokens_after)
        # On an accelerator the hold's checksums are what a consumer verifies with: a step's end on
        # the host is not the device's (prefill/kv/device_progress.py).
        if reports is self.progress:
            self._completing = [step for step in meta.layerwise_steps if step.prompt_token_ids is not None]

    def layer_saved(self, layer_name: str) -> None:
        """vLLM launched (on the CPU: wrote) this step's KV of a layer (engine thread: a dict lookup
        when no transfer is layer-wise)."""
        if self._progress_reports is not None:
            self._progress_reports.layer_done(self._layer_index[layer_name])

    def step_saved(self) -> None:
        if self._progress_reports is not None:
            if self._slow_step:  # fault tests: a slow prefill, to stop or kill mid-way
                time.sleep(self._transport.kv_faults.slow_step_s)
            self._progress_reports.step_done()
            for step in self._completing:
                self._checksum_pool.submit(self._publish_written, step, self.progress.restarts(step.transfer_id))
            self._completing = []

    def _publish_written(self, step: LayerwiseStep, restarts: int) -> None:
        """The prompt's content hashes and checksums, published for its consumer once computed (off the
        engine thread). Its blocks are the running request's until the hold: an abort that frees them
        ends the transfer before the next step can write them (end_freed_transfers, before vLLM's
        batch update), so what was published was computed from the prompt's KV; what a consumer
        reads after that fails these checksums."""
        hashes = self._block_hashes(step.prompt_token_ids, step.extra_key)
        block_ids = tuple(step.block_ids[:len(hashes)])
        checksums: Future = Future()
        checksums.set_result(self._paged.block_checksums(list(block_ids)))
        self.progress.written(step.transfer_id, HeldTransfer(
            step.transfer_id, block_ids, tuple(hashes), deadline=float("inf"), request_id=step.pdmesh_request_id,
            checksums=checksums), restarts)

    def get_finished(self) -> tuple[set[str] | None, set[str] | None]:
        finished_sending = self.held.take_finished() if self._is_producer else set()
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
        total = self.ledger.total()
        servicer = self._servicer
        saver = self.saver
        return (self.store.counters() if self.store else {}) | ({
            "kv_store_saves_skipped": saver.num_skipped, "kv_store_blocks_skipped": saver.num_skipped_blocks,
            "kv_store_saves_pending": saver.num_pending,
        } if saver else {}) | {
            "kv_blocks_received": total["num_blocks"], "kv_bytes_received": total["num_bytes"],
            "kv_failed_blocks": total["num_failed_blocks"],
            "engine_worker_steps": self._num_steps,
            "kv_blocks_sent": servicer.num_blocks_sent if servicer else 0,
            "kv_bytes_sent": servicer.num_bytes_sent if servicer else 0,
            "kv_bytes_sent_by_transport": dict(servicer.bytes_sent_by_transport) if servicer else {},
            # blocks pinned for consumers: the engine's held transfers and the store's exports
            "num_held_transfers": self.held.num_held + (self.store.exports.num_held if self.store else 0),
            "num_expired_transfers": self.held.num_expired + (self.store.exports.num_expired if self.store else 0),
        }

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._layerwise_pool.shutdown(wait=True, cancel_futures=True)
        self._checksum_pool.shutdown(wait=True, cancel_futures=True)
        if isinstance(self._progress_reports, DeviceOrderedProgress):
            self._progress_reports.close()
        if self.saver is not None:
            self.saver.shutdown()
        if self._server is not None:
            self._server.stop(grace_s=0.5)
        if self.store is not None:
            self.store.close()
        for links in self._links.values():
            links.close()
        for exporter in self._exporters + self._store_exporters:
            exporter.close()
        if self._wakeups is not None:
            self._wakeups.close()
        shutdown_tracing(self._tracer_provider)

    def _block_hashes(self, token_ids: list[int], extra_key: bytes) -> list[bytes]:
        """The chained content hashes of the blocks holding token_ids (the partial last one too)."""
        return chain_block_hashes(fingerprint_seed(self.compat), token_ids, self._block_size, extra_key,
                                  include_partial=True)

    def _written(self, send: SendTask) -> HeldTransfer | None:
        written = self.progress.written_transfer(send.transfer_id) if self.progress is not None else None
        return written if written is not None and written.block_ids == tuple(send.block_ids) else None

    def _hold(self, send: SendTask, checksums: Future | None = None) -> None:
        if checksums is None and self._exporters:
            checksums = self._checksum_pool.submit(self._paged.block_checksums, list(send.block_ids))
        self.held.hold(HeldTransfer(send.transfer_id, tuple(send.block_ids), tuple(send.block_hashes),
                                    deadline=time.monotonic() + self._hold_timeout_s,
                                    request_id=send.pdmesh_request_id, engine_request_id=send.engine_request_id,
                                    checksums=checksums))

    def _load(self, task: StoreLoadTask) -> None:
        token = context.attach(extract_carrier(task.trace_carrier))
        try:
            with tracer().start_as_current_span("kvstore.load") as span:
                settings = self._store_settings
                budget_s = max(settings.load_budget_min_s, settings.load_budget_factor * self.compute_rate.seconds_for(
                    len(task.block_indexes) * self._block_size))
                stats = self.store.load(task, self._paged.write_blocks, budget_s)
                span.set_attributes({"pdmesh.kvstore.budget_s": budget_s, "pdmesh.kvstore.cut": stats.cut,
                    **{f"pdmesh.kvstore.tokens.{tier}": n for tier, n in stats.tokens_by_tier.items()},
                    "pdmesh.kvstore.blocks": stats.num_blocks, "pdmesh.kvstore.failed_blocks": stats.num_failed_blocks,
                    "pdmesh.kv.bytes": stats.num_bytes, "pdmesh.kv.duration_s": stats.seconds,
                    "pdmesh.kv.transport": stats.transport})
        finally:
            context.detach(token)
        with self._lock:
            self._failed_block_ids.update(task.local_block_ids[stats.num_blocks:])
            self._done_recving.add(task.request_id)
            self._stats_pending[task.request_id] = asdict(stats)
        self._transfer_finished()

    def _transfer_finished(self) -> None:
        """A pull or load is in _done_recving: the engine core steps its workers to learn it."""
        if self._wakeups is not None:
            self._wakeups.transfer_finished()

    def _receive(self, task: RecvTask) -> None:
        """Reads, reports the request received (it can run from the next engine step on), then
        releases the producer's blocks: the release is off the request's path."""
        token = context.attach(extract_carrier(task.trace_carrier))
        try:
            with tracer().start_as_current_span("kv.transfer") as span:
                stats = self._receive_traced(task, span)
            self.ledger.record(stats)
            with self._lock:
                self._failed_block_ids.update(task.local_block_ids[stats.num_blocks:])
                if task.report_done:
                    self._done_recving.add(task.request_id)
                    self._stats_pending[task.request_id] = asdict(stats)
            if task.report_done:
                self._transfer_finished()
        finally:
            self._release(task)
            context.detach(token)

    def _receive_traced(self, task: RecvTask, span) -> TransferStats:
        started = time.perf_counter()
        stats, result, transport = TransferStats(), "ok", ""
        try:
            if task.block_indexes:
                transport = self._pull_into_cache(task, stats)
        except Exception as exc:  # noqa: BLE001 - a failed pull becomes recompute, never a crash
            result = "mismatch" if isinstance(exc, (ChecksumMismatch, BlockHashMismatch)) else "error"
            span.record_exception(exc)
            logger.warning("request %s: KV pull failed (%s); blocks will be recomputed", task.request_id, exc)
        stats.transport = transport
        stats.seconds = time.perf_counter() - started
        stats.num_failed_blocks = len(task.block_indexes) - stats.num_blocks
        stats.num_local_tokens = task.num_local_tokens
        stats.num_reused_tokens = min(len(task.token_ids), task.num_local_tokens + stats.num_blocks * self._block_size)
        if task.layerwise:
            span.set_attributes({"pdmesh.kv.layerwise": True, "pdmesh.kv.layer_reads": stats.num_layer_reads,
                                 "pdmesh.kv.seconds_before_prefill_done": stats.seconds_before_prefill_done,
                                 "pdmesh.kv.seconds_after_prefill_done": stats.seconds_after_prefill_done,
                                 "pdmesh.kv.overlap_ratio": stats.overlap_ratio})
        span.set_attributes({
            "pdmesh.kv.transport": transport, "pdmesh.kv.checksum": result, "pdmesh.kv.peer": task.kv_address,
            "pdmesh.kv.producer_tp_size": task.producer_tp_size,
            "pdmesh.kv.blocks": stats.num_blocks, "pdmesh.kv.failed_blocks": stats.num_failed_blocks,
            "pdmesh.kv.bytes": stats.num_bytes, "pdmesh.kv.duration_s": stats.seconds,
            "pdmesh.kv.first_block_s": stats.first_block_seconds,
            "pdmesh.kv.gbps": stats.num_bytes / stats.seconds / 1e9 if stats.seconds > 0 else 0.0,
        })
        return stats

    def _pull_into_cache(self, task: RecvTask, stats: TransferStats) -> str:
        """Reads the task's blocks from each producer rank holding its heads, through the transport
        agreed with that rank; counts into `stats` as blocks land on every rank's share, so a failure
        part-way keeps the prefix that arrived whole (the ranks after a failed one read only up to
        it), then raises the first failure. Returns the transport."""
        expected = _LazyHashes(lambda: self._block_hashes(task.token_ids, task.extra_key))
        started = time.perf_counter()
        num_whole, failure, transports = len(task.block_indexes), None, []
        timing = LayerwiseTiming() if task.layerwise else None
        for address, head_slice in self._sources(task):
            links = self._links_for(head_slice)
            num_landed = 0
            try:
                link = links.link(address)
                transports.append(link.transport)
                for num_landed in self._read(links, link, task, num_whole, expected, timing):
                    if not stats.first_block_seconds:
                        stats.first_block_seconds = time.perf_counter() - started
            except Exception as exc:  # noqa: BLE001 - reported below, once the other ranks' shares are in
                if not isinstance(exc, BlockHashMismatch):
                    # the producer may be gone, or back on this address with other memory (a stale
                    # mapping reads as a checksum mismatch): handshake again next time
                    links.forget(address)
                failure = failure or exc
            num_whole = min(num_whole, num_landed)
        stats.num_blocks = num_whole
        stats.num_bytes = num_whole * self.compat.block_nbytes
        if timing is not None:
            stats.layerwise, stats.num_layer_reads = True, timing.num_layer_reads
            stats.seconds_before_prefill_done = timing.seconds_before_prefill_done
            stats.seconds_after_prefill_done = timing.seconds_after_prefill_done
            stats.overlap_ratio = timing.overlap_ratio
        if failure is not None:
            raise failure
        return "+".join(sorted(set(transports)))

    def _read(self, links: KVLinks, link, task: RecvTask, num_blocks: int, expected,
              timing: LayerwiseTiming | None):
        """The reads of the task's first num_blocks blocks from one producer rank (layer by layer
        while it prefills, in the layer-wise flow)."""
        reader, indexes, local_ids = links.reader(link), task.block_indexes[:num_blocks], task.local_block_ids[:num_blocks]
        if timing is None:
            return reader.read_blocks(link, task.transfer_id, indexes, local_ids, expected, self._read_options(task))
        target = LayerwiseTarget(self._block_size, len(task.token_ids), self._paged.num_layers, self._pull_timeout_s)
        return read_layerwise(reader, links.control, link, task.transfer_id, indexes, local_ids, expected, target,
                              timing, self._read_options(task))

    def _sources(self, task: RecvTask) -> list[tuple[str, tuple[int, int]]]:
        """(KV port, head slice of the local cache it fills) of each producer rank this rank reads:
        its peer rank when both sides have as many ranks, else the k ranks holding its heads."""
        ratio = tp_ratio(task.producer_tp_size, self._tp_size)
        first = self._tp_rank * ratio
        return [(_rank_address(task.kv_address, first + j), (j, ratio) if ratio > 1 else WHOLE) for j in range(ratio)]

    def _read_options(self, task: RecvTask) -> ReadOptions:
        faults = self._transport.kv_faults
        tamper = faults.tamper_request_prefix and task.pdmesh_request_id.startswith(faults.tamper_request_prefix)
        unverified = (faults.unverified_request_prefix
                      and task.pdmesh_request_id.startswith(faults.unverified_request_prefix))
        stall = faults.stall_request_prefix and task.pdmesh_request_id.startswith(faults.stall_request_prefix)
        return ReadOptions(verify=not unverified, tamper=_overwrite if tamper else None,
                           stall_s=faults.stall_s if stall else 0.0)

    def _release(self, task: RecvTask) -> None:
        """Frees the transfer on every producer rank this rank read (each holds its own pin); when
        it could read none, on its share of the producer's ranks."""
        try:
            addresses = [address for address, _ in self._sources(task)]
        except Incompatible:
            addresses = [_rank_address(task.kv_address, rank) for rank in range(task.producer_tp_size)
                         if rank % self._tp_size == self._tp_rank]
        except ValueError:  # an address without a port: nothing was read
            return
        control = self._links_for(WHOLE).control
        wait_briefly([control.release_soon(address, task.transfer_id) for address in addresses])


class _LazyHashes:
    """The request's block hashes, computed on first use (while the reader's first call travels)."""

    def __init__(self, compute) -> None:
        self._compute = compute
        self._hashes: list[bytes] | None = None

    def __getitem__(self, index: int) -> bytes:
        if self._hashes is None:
            self._hashes = self._compute()
        return self._hashes[index]


def _rank_address(address: str, rank: int) -> str:
    """The KV port of a producer's rank (rank 0's port + rank)."""
    host, port = address.rsplit(":", 1)
    return f"{host}:{int(port) + rank}"


def _overwrite(buffer) -> None:
    """The fault tests' tamper: KV bytes replaced between producer and consumer."""
    np.asarray(buffer, dtype=np.uint8)[...] = 0x40

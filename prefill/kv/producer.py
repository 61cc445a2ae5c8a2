"""The producer half in an engine's model worker: pins the blocks of finished prefills until their
consumer releases them (or the hold times out), serves them on the KV port (the control path of
every transport, and the gRPC transport's data), offers the KV cache in place to the
registered-memory transports (shared memory, Mooncake), and reports layer-wise progress as the
engine writes each layer.

`paged` is the engine's paged KV cache (worker/paged_kv.py); `store` the node's KV store agent
(kvstore/store_agent.py), whose exports this port serves too."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from pdmesh.config import KVTransportSettings
from pdmesh.kv.fault_hooks import NO_FAULTS, KVFaultHooks
from pdmesh.kv.kv_layout import piece_sizes
from pdmesh.kv.tasks import LayerwiseStep, SendTask
from pdmesh.transport.affinity import widen_affinity
from pdmesh.transport.kv_transport import GRPC, MOONCAKE, SHM
from pdmesh.transport.mooncake.engine import MooncakeEngine, mooncake_available
from pdmesh.v1 import common_pb2
from prefill.kv.device_progress import DeviceOrderedProgress, ordered_progress
from prefill.kv.grpc_kv_server import GrpcKVServer, KVTransferServicer
from prefill.kv.held_transfers import HeldTransfer, HeldTransfers
from prefill.kv.layer_progress import LayerProgress
from prefill.kv.mooncake_exporter import MooncakeKVExporter
from prefill.kv.shm_exporter import ShmKVExporter

logger = logging.getLogger(__name__)


class KVProducer:
    def __init__(self, *, paged, compat: common_pb2.CompatInfo, block_size: int, kv_host: str, kv_port: int,
                 advertise_host: str, advertise_port: int, hold_timeout_s: float, transport: KVTransportSettings,
                 mooncake_engine: Callable[[], MooncakeEngine], store=None,
                 faults: KVFaultHooks = NO_FAULTS) -> None:
        self._paged = paged
        self._hold_timeout_s = hold_timeout_s
        self._transport = transport
        self._mooncake_engine = mooncake_engine
        self._store = store
        self._faults = faults
        self.held = HeldTransfers()
        num_layers = paged.num_layers
        # transfers read layer by layer while prefilled, and where the engine thread reports that
        # progress (through the device's events on an accelerator)
        self.progress = LayerProgress(num_layers, self.held,
                                      layer_bytes_per_token=paged.block_nbytes // (num_layers * block_size),
                                      min_read_bytes=transport.layerwise_read_bytes)
        self._reports: LayerProgress | DeviceOrderedProgress = ordered_progress(self.progress, paged.device)
        self._step_delay_s = 0.0                     # fault tests: this step is slowed (KVFaultHooks)
        self._completing: list[LayerwiseStep] = []   # this step completes these layer-wise prompts
        self._ends_applied_for = None                # the step whose ends were applied
        # checksums of newly held blocks for the registered-memory transports, off the engine thread
        self._checksum_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pdmesh-kv-sum",
                                                 initializer=widen_affinity)
        self.exporters: list = []          # the registered-memory transports this producer offers, best first
        self._store_exporters: list = []   # those other nodes read this node's store exports with
        try:
            self._make_exporters()
            if store is not None:
                self._make_store_exporters()
            self.servicer = KVTransferServicer(compat, self.held, lambda block_ids: paged.read_blocks(block_ids).numpy(),
                                               exporters=self.exporters, block_checksums=paged.block_checksums,
                                               serve_grpc=transport.allows(GRPC), read_run=paged.read_bytes,
                                               store=store.exports if store is not None else None,
                                               store_exporters=self._store_exporters, progress=self.progress,
                                               read_layers=lambda ids, layers: paged.read_blocks(ids, layers).numpy(),
                                               layer_pieces=piece_sizes(paged.regions()))
            self.server = GrpcKVServer(self.servicer, kv_host, kv_port,
                                       extra_services=[store.extra_service()] if store is not None else [],
                                       auth=transport.auth)
        except BaseException:   # a port that did not bind: what was moved, registered or started is undone
            self._close_exporters()
            self._checksum_pool.shutdown(wait=False)
            if isinstance(self._reports, DeviceOrderedProgress):
                self._reports.close()
            raise
        self.address = f"{advertise_host}:{advertise_port or int(self.server.address.rsplit(':', 1)[1])}"
        logger.info("pdmesh KV server on %s%s, transports %s", self.server.address,
                    " (with KV store)" if store is not None else "",
                    [e.transport for e in self.exporters] + ([GRPC] if transport.allows(GRPC) else []))

    def _make_exporters(self) -> None:
        """The registered-memory transports this producer offers, best first. The shared-memory move
        comes first: it changes the cache's addresses, which Mooncake then registers."""
        exporters, paged, transport = self.exporters, self._paged, self._transport
        if transport.allows(SHM) and paged.in_place:
            try:
                exporters.append(ShmKVExporter(paged.share_memory()))
            except OSError as exc:
                logger.warning("KV cache not offered over shared memory: %s", exc)
        if transport.allows(MOONCAKE) and paged.in_place and mooncake_available():
            exporters.append(MooncakeKVExporter(self._mooncake_engine(), paged.regions()))
        if transport.kv_transport not in ("auto", GRPC) and not exporters:
            raise RuntimeError(f"kv_transport={transport.kv_transport} is not available in this process")

    def _make_store_exporters(self) -> None:
        """The registered-memory transports other nodes read this node's store exports with (its
        export slab is host memory, on every device)."""
        exports, exporters = self._store.exports, self._store_exporters
        shared = exports.shared_regions()
        if self._transport.allows(SHM) and shared is not None:
            exporters.append(ShmKVExporter(shared))
        if self._transport.allows(MOONCAKE) and mooncake_available():
            exporters.append(MooncakeKVExporter(self._mooncake_engine(), exports.regions(),
                                                registered=[exports.registered_region()]))

    def start_step(self, layerwise_steps: list[LayerwiseStep], minted: list[str], unheld: list[str], meta) -> None:
        """A step's producer work before its forward: ids minted and dropped, layer-wise steps begun."""
        self._track_layerwise(layerwise_steps, meta)
        self.held.announce(minted)  # a read of one waits for its hold; of any other id, not
        self.held.drop_announced(unheld)

    def adopt_written(self, send: SendTask) -> HeldTransfer | None:
        """A layer-wise prompt's transfer, already published (returned, for `hold`): the send takes
        the names it was published under (else it keeps those the scheduler side gave it)."""
        written = self._written(send)
        if written is not None:
            send.block_hashes = list(written.block_hashes)
        return written

    def hold(self, send: SendTask, written: HeldTransfer | None) -> None:
        """Pins the send's blocks for its consumer, with their checksums (a layer-wise prompt's, already
        computed; else computed off the engine thread where a registered-memory transport needs them)."""
        checksums: Future | None = written.checksums if written is not None else None
        if checksums is None and self.exporters:
            checksums = self._checksum_pool.submit(self._paged.block_checksums, list(send.block_ids))
        self.held.hold(HeldTransfer(send.transfer_id, tuple(send.block_ids), tuple(send.block_hashes),
                                    deadline=time.monotonic() + self._hold_timeout_s,
                                    request_id=send.pdmesh_request_id, engine_request_id=send.engine_request_id,
                                    checksums=checksums))
        self._reports.held(send.transfer_id)  # after the hold: a Watch sees one or the other

    def end_freed_transfers(self, meta) -> None:
        """Layer-wise transfers whose request ended unheld or was preempted: their blocks are freed, and
        nothing read or computed of them from here on is published (before vLLM's batch update,
        which may write the blocks; start_step does it when vLLM does not call this)."""
        if meta is self._ends_applied_for:
            return
        self._ends_applied_for = meta
        for transfer_id in meta.layerwise_ended:
            self._reports.end(transfer_id)
        for transfer_id in meta.layerwise_restarted:
            self._reports.restart(transfer_id)

    def _track_layerwise(self, steps: list[LayerwiseStep], meta) -> None:
        self._step_delay_s = self._faults.step_delay_s(step.pdmesh_request_id for step in steps)
        self.end_freed_transfers(meta)
        for step in steps:
            self._reports.start_step(step.transfer_id, step.pdmesh_request_id, step.block_ids,
                                     step.num_tokens_before, step.num_tokens_after)
        # On an accelerator the hold's checksums are what a consumer verifies with: a step's end on
        # the host is not the device's (prefill/kv/device_progress.py).
        if self._reports is self.progress:
            self._completing = [step for step in steps if step.block_hashes is not None]

    def layer_saved(self, layer_index: int) -> None:
        """vLLM launched (on the CPU: wrote) this step's KV of a layer."""
        self._reports.layer_done(layer_index)

    def step_saved(self) -> None:
        if self._step_delay_s:  # fault tests: a slow prefill, to stop or kill mid-way
            time.sleep(self._step_delay_s)
        self._reports.step_done()
        for step in self._completing:
            self._checksum_pool.submit(self._publish_written, step, self.progress.restarts(step.transfer_id))
        self._completing = []

    def _publish_written(self, step: LayerwiseStep, restarts: int) -> None:
        """The prompt's content hashes and checksums, published for its consumer once computed (off the
        engine thread). Its blocks are the running request's until the hold: an abort that frees them
        ends the transfer before the next step can write them (end_freed_transfers, before vLLM's
        batch update), so what was published was computed from the prompt's KV; what a consumer
        reads after that fails these checksums."""
        hashes = step.block_hashes
        block_ids = tuple(step.block_ids[:len(hashes)])
        checksums: Future = Future()
        checksums.set_result(self._paged.block_checksums(list(block_ids)))
        self.progress.written(step.transfer_id, HeldTransfer(
            step.transfer_id, block_ids, tuple(hashes), deadline=float("inf"), request_id=step.pdmesh_request_id,
            checksums=checksums), restarts)

    def _written(self, send: SendTask) -> HeldTransfer | None:
        written = self.progress.written_transfer(send.transfer_id)
        return written if written is not None and written.block_ids == tuple(send.block_ids) else None

    def counters(self) -> dict:
        exports = self._store.exports if self._store is not None else None
        return {
            "kv_blocks_sent": self.servicer.num_blocks_sent,
            "kv_bytes_sent": self.servicer.num_bytes_sent,
            "kv_bytes_sent_by_transport": dict(self.servicer.bytes_sent_by_transport),
            # blocks pinned for consumers: the engine's held transfers and the store's exports
            "num_held_transfers": self.held.num_held + (exports.num_held if exports else 0),
            "num_expired_transfers": self.held.num_expired + (exports.num_expired if exports else 0),
        }

    def close(self) -> None:
        self._checksum_pool.shutdown(wait=True, cancel_futures=True)
        if isinstance(self._reports, DeviceOrderedProgress):
            self._reports.close()
        self.server.stop(grace_s=0.5)
        self._close_exporters()

    def _close_exporters(self) -> None:
        for exporter in self.exporters + self._store_exporters:
            exporter.close()

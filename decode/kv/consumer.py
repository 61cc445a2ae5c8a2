"""The consumer half in an engine's model worker: reads the blocks RecvTasks name from their
producer, through the transport agreed with that producer (pdmesh/transport/kv_transport.py), each
block verified (content hash, checksum of the landed bytes) as it lands in the paged KV cache;
then reports the request received (with any blocks that did not land, which vLLM recomputes) and
releases the producer's pin, off the request's path.

`paged` is the engine's paged KV cache (worker/paged_kv.py): regions, views and write_blocks."""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch
from opentelemetry import context

from decode.kv.grpc_kv_reader import GrpcKVReader
from decode.kv.kv_links import KVLinks
from decode.kv.kv_port_client import KVPortClient, wait_briefly
from decode.kv.layerwise_read import LayerwiseTarget, LayerwiseTiming, read_layerwise
from decode.kv.mooncake_reader import MooncakeKVReader
from decode.kv.peer_tasks import PerPeerExecutor
from decode.kv.shm_reader import ShmKVReader
from decode.kv.transfer_stats import TransferLedger
from pdmesh.compat import tp_ratio
from pdmesh.config import KVTransportSettings
from pdmesh.errors import BlockHashMismatch, ChecksumMismatch, Incompatible
from pdmesh.kv.fault_hooks import NO_FAULTS, KVFaultHooks
from pdmesh.kv.kv_layout import WHOLE, piece_sizes
from pdmesh.kv.request_stats import PullStats
from pdmesh.kv.tasks import RecvTask
from pdmesh.telemetry.tracing import extract_carrier, tracer
from pdmesh.transport.affinity import parse_cpus, widen_affinity
from pdmesh.transport.kv_transport import GRPC, MOONCAKE, SHM, ReadOptions
from pdmesh.transport.mooncake.engine import MooncakeEngine, mooncake_available, shared_engine
from pdmesh.v1 import common_pb2

logger = logging.getLogger(__name__)
MAX_LAYERWISE_READS = 64
# Pulls (and a producer's store loads) run on a few threads, at most 2 per producer (as many as every
# pull had before): a producer that stops answering holds its 2 until their reads time out, not all.
TRANSFER_THREADS, TRANSFER_THREADS_PER_PEER = 8, 2

# What a finished read hands back: the task, its stats, and whether it counts (RecvTask.report_done).
OnReceived = Callable[[RecvTask, PullStats], None]


def mooncake_engine(transport: KVTransportSettings, timeout_s: float) -> MooncakeEngine:
    """The process's Mooncake engine (one per process, shared by its exporters and readers)."""
    return shared_engine(transport.mooncake_host, transport.mooncake_protocol, transport.mooncake_device, timeout_s)


def kv_readers(paged, transport: KVTransportSettings, control: KVPortClient, timeout_s: float,
               head_slice: tuple[int, int] = WHOLE) -> list:
    """The transports a consumer reads with, best first, landing blocks in `head_slice` of each
    piece of `paged` (WHOLE: the whole block)."""
    readers = []
    if paged.in_place and (transport.allows(SHM) or transport.allows(MOONCAKE)):
        regions = paged.slice_regions(head_slice) if head_slice != WHOLE else paged.regions()
        views = paged.views(regions)
    if paged.in_place and transport.allows(SHM):
        readers.append(ShmKVReader(control, regions, views))
    if paged.in_place and transport.allows(MOONCAKE) and mooncake_available():
        readers.append(MooncakeKVReader(mooncake_engine(transport, timeout_s), control, regions, views))
    if transport.allows(GRPC):
        pieces = [(region.num_parts, region.part_nbytes // head_slice[1]) for region in paged.regions()]
        readers.append(GrpcKVReader(control, lambda ids, rows, layers=None: paged.write_blocks(
            ids, torch.from_numpy(rows), head_slice, layers), pieces))
    if not readers:
        raise RuntimeError(f"kv_transport={transport.kv_transport} is not available in this process")
    return readers


class KVConsumer:
    def __init__(self, *, paged, compat: common_pb2.CompatInfo, block_size: int, transport: KVTransportSettings,
                 pull_timeout_s: float, on_received: OnReceived, tp_rank: int = 0,
                 tp_size: int = 1, thread_cpus: str = "", faults: KVFaultHooks = NO_FAULTS) -> None:
        self._paged = paged
        self._compat = compat
        self._block_size = block_size
        self._transport = transport
        self._pull_timeout_s = pull_timeout_s
        self._on_received = on_received
        self._faults = faults
        # A consumer rank reads the producer ranks holding its heads: the same rank when both have as
        # many ranks; k ranks' head shares when the producer has k times as many.
        self._tp_rank, self._tp_size = tp_rank, tp_size
        self.ledger = TransferLedger()
        self._lock = threading.Lock()
        self._links: dict[tuple[int, int], KVLinks] = {}  # by head slice (j, k) of the local cache they fill
        self.pool = PerPeerExecutor(TRANSFER_THREADS, TRANSFER_THREADS_PER_PEER, thread_name_prefix="pdmesh-kv-recv",
                                    initializer=widen_affinity)
        # Layer-wise reads mostly wait for the producer's next layer: one thread each, up to this many
        # at once (a read queued behind them starts late and hides less of its transfer). They run while
        # the producer computes, so they stay on this worker's cores (--process_cpus; every core when
        # unset): widened like the pulls', they took prefill's core on a shared host.
        self._layerwise_pool = ThreadPoolExecutor(max_workers=MAX_LAYERWISE_READS, thread_name_prefix="pdmesh-kv-lw",
                                                  initializer=functools.partial(widen_affinity,
                                                                                parse_cpus(thread_cpus)))
        self.links_for(WHOLE)

    def submit(self, recv: RecvTask) -> None:
        if recv.layerwise:
            self._layerwise_pool.submit(self._receive, recv)
        else:
            self.pool.submit(recv.kv_address, self._receive, recv)

    def links_for(self, head_slice: tuple[int, int]) -> KVLinks:
        """This consumer's links to producers whose blocks fill `head_slice` of its cache."""
        with self._lock:
            links = self._links.get(head_slice)
            if links is None:
                # the producer's blocks hold the heads of this slice: pieces 1/k of this cache's
                pieces = [[nbytes // head_slice[1] for nbytes in layer] for layer in piece_sizes(self._paged.regions())]
                control = KVPortClient(self._compat, self._pull_timeout_s, self._transport.auth, pieces)
                readers = kv_readers(self._paged, self._transport, control, self._pull_timeout_s, head_slice)
                links = self._links[head_slice] = KVLinks(control, readers)
            return links

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        self._layerwise_pool.shutdown(wait=True, cancel_futures=True)
        for links in self._links.values():
            links.close()

    def _receive(self, task: RecvTask) -> None:
        """Reads, reports the request received (it can run from the next engine step on), then
        releases the producer's blocks: the release is off the request's path."""
        token = context.attach(extract_carrier(task.trace_carrier))
        try:
            with tracer().start_as_current_span("kv.transfer") as span:
                stats = self._receive_traced(task, span)
            self.ledger.record(stats)
            self._on_received(task, stats)
        finally:
            self._release(task)
            context.detach(token)

    def _receive_traced(self, task: RecvTask, span) -> PullStats:
        started = time.perf_counter()
        stats, result, transport = PullStats(), "ok", ""
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

    def _pull_into_cache(self, task: RecvTask, stats: PullStats) -> str:
        """Reads the task's blocks from each producer rank holding its heads, through the transport
        agreed with that rank; counts into `stats` as blocks land on every rank's share, so a failure
        part-way keeps the prefix that arrived whole (the ranks after a failed one read only up to
        it), then raises the first failure. Returns the transport."""
        expected = task.block_hashes
        started = time.perf_counter()
        num_whole, failure, transports = len(task.block_indexes), None, []
        timing = LayerwiseTiming() if task.layerwise else None
        for address, head_slice in self._sources(task):
            links = self.links_for(head_slice)
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
        stats.num_bytes = num_whole * self._compat.block_nbytes
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
        return [(rank_address(task.kv_address, first + j), (j, ratio) if ratio > 1 else WHOLE) for j in range(ratio)]

    def _read_options(self, task: RecvTask) -> ReadOptions:
        return self._faults.read_options(task.pdmesh_request_id)

    def _release(self, task: RecvTask) -> None:
        """Frees the transfer on every producer rank this rank read (each holds its own pin); when
        it could read none, on its share of the producer's ranks."""
        try:
            addresses = [address for address, _ in self._sources(task)]
        except Incompatible:
            addresses = [rank_address(task.kv_address, rank) for rank in range(task.producer_tp_size)
                         if rank % self._tp_size == self._tp_rank]
        except ValueError:  # an address without a port: nothing was read
            return
        control = self.links_for(WHOLE).control
        wait_briefly([control.release_soon(address, task.transfer_id) for address in addresses])


def rank_address(address: str, rank: int) -> str:
    """The KV port of a producer's rank (rank 0's port + rank)."""
    host, port = address.rsplit(":", 1)
    return f"{host}:{int(port) + rank}"

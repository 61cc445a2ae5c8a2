"""The producer's KV port, run inside the engine's worker process: the control path of every
transport (handshake, open, release) and the gRPC transport's streamed pull.

That process has no asyncio loop and runs model steps on its main thread, so this is a
thread-pool `grpc.server`: reads of held (immutable) blocks happen off the engine thread. The calls
that can hold a thread for long have budgets of them (KV_PORT_BUDGETS): past one, a call is refused
with RESOURCE_EXHAUSTED, so no peer can take every thread; a read of a transfer id the engine never
announced is refused at once (prefill/kv/held_transfers.py).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent import futures
from dataclasses import dataclass
from typing import Protocol

import grpc
import numpy as np
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from opentelemetry.instrumentation.grpc import server_interceptor

from pdmesh.compat import check_compatible, check_readable
from pdmesh.errors import Incompatible, InvalidRequest, PDMeshError, TransferNotFound
from pdmesh.kv.checksum import pieces_of
from pdmesh.malformed_requests import RejectMalformedRequestsSync
from pdmesh.status_map import error_metadata, grpc_status_of
from pdmesh.telemetry.tracing import tracer
from pdmesh.tls import server_credentials
from pdmesh.transport.chunking import DEFAULT_CHUNK_NBYTES, blocks_per_chunk, iter_chunks, run_chunk
from pdmesh.transport.grpc_options import GRPC_OPTIONS
from pdmesh.transport.kv_transport import GRPC, KVExporter
from pdmesh.transport.mesh_auth import MeshAuth, MeshTokenInterceptor
from pdmesh.transport.pull_timing import PullTiming
from pdmesh.v1 import common_pb2, kv_store_pb2, kv_transfer_pb2, kv_transfer_pb2_grpc
from prefill.kv.held_transfers import HeldTransfer, HeldTransfers
from prefill.kv.layer_progress import LayerProgress
from prefill.kv.rpc_budgets import RpcBudget, RpcBudgetInterceptor, threads_for

logger = logging.getLogger(__name__)
BlockReader = Callable[[list[int]], np.ndarray]  # engine block ids -> (n, block_nbytes) uint8 rows
BlockChecksums = Callable[[list[int]], list[int]]  # engine block ids -> checksum of each block's bytes
MAX_WATCH_MS = 5000  # a Watch holds one of the server's threads at most this long
_KV = "/" + kv_transfer_pb2.DESCRIPTOR.services_by_name["KVTransfer"].full_name
_STORE = "/" + kv_store_pb2.DESCRIPTOR.services_by_name["KVStore"].full_name
# The calls that can hold a thread for long, and how many of each run at once: a Watch long-polls
# (a layer-wise consumer keeps one going per read, up to decode's 64); an Open or Pull may wait for
# its hold and a Pull streams to its reader's pace; a store Export reads the store's tiers and a
# Lookup may ask Redis. Past its budget a call is answered RESOURCE_EXHAUSTED at once.
KV_PORT_BUDGETS = (
    RpcBudget("watch", (f"{_KV}/Watch",), 64),
    RpcBudget("open", (f"{_KV}/Open",), 16),
    RpcBudget("pull", (f"{_KV}/Pull",), 16),
    RpcBudget("store export", (f"{_STORE}/Export",), 4),
    RpcBudget("store lookup", (f"{_STORE}/Lookup",), 4),
)
FREE_THREADS = 8  # threads left for what no budget holds (handshakes, releases, health) when all are in use


class ExportedTransfers(Protocol):
    """Transfers held in other memory than the engine's KV cache: the node's KV store exports
    (kvstore/store_export.py), read through the same Open / Pull / Release."""

    def find(self, transfer_id: str) -> HeldTransfer | None:
        ...

    def read_rows(self, block_ids: list[int]) -> np.ndarray:
        ...

    def release(self, transfer_id: str) -> bool:
        ...

    def ended(self, transfer_id: str) -> bool:
        ...

    def lease(self, transfer_id: str) -> bool:
        ...

    def unlease(self, transfer_id: str) -> None:
        ...


class KVTransferServicer(kv_transfer_pb2_grpc.KVTransferServicer):
    def __init__(
        self,
        compat: common_pb2.CompatInfo,
        held: HeldTransfers,
        read_blocks: BlockReader,
        wait_timeout_s: float = 10.0,
        chunk_nbytes: int = DEFAULT_CHUNK_NBYTES,
        exporters: Sequence[KVExporter] = (),
        block_checksums: BlockChecksums | None = None,
        serve_grpc: bool = True,
        read_run: Callable[[list[int]], bytes] | None = None,
        store: ExportedTransfers | None = None,
        store_exporters: Sequence[KVExporter] = (),
        progress: LayerProgress | None = None,
        read_layers: Callable[[list[int], range], np.ndarray] | None = None,
        layer_pieces: Sequence[Sequence[int]] | None = None,
    ) -> None:
        """layer_pieces: each layer's piece sizes in a block (of the cache and the store's exports
        alike), which the gRPC pull's checksums cover (pdmesh/kv/checksum.py; None: one piece)."""
        self._compat = compat
        self._layer_pieces = layer_pieces
        self._held = held
        self._read_blocks = read_blocks
        self._exporters = list(exporters)   # registered-memory transports, in order of preference
        self._block_checksums = block_checksums
        self._serve_grpc = serve_grpc       # False: a transport is forced, gRPC is not offered
        self._read_run = read_run           # blocks' wire bytes in one copy from the cache (host memory)
        self._store = store                 # the node's KV store exports, if it has a store
        self._store_exporters = list(store_exporters)  # the transports that read the store's export slab
        self._progress = progress           # transfers still being prefilled (the layer-wise flow)
        self._read_layers = read_layers     # engine block ids, layers -> those layers' rows (gRPC layer reads)
        self._wait_timeout_s = wait_timeout_s
        self._chunk_nbytes = chunk_nbytes
        self._lock = threading.Lock()
        self.num_blocks_sent = 0
        self.num_bytes_sent = 0
        self.bytes_sent_by_transport: dict[str, int] = {}

    def Handshake(self, request, context):
        try:
            # a decode with fewer tensor-parallel ranks reads this rank's heads; a store peer is alike
            (check_compatible if request.store else check_readable)(self._compat, request.compat)
            return self._choose(request)
        except PDMeshError as exc:
            self._abort(context, exc)

    def _choose(self, request: kv_transfer_pb2.HandshakeRequest) -> kv_transfer_pb2.HandshakeResponse:
        wanted = set(request.transports)
        if request.store and self._store is None:
            raise Incompatible("this node has no KV store")
        exporters = self._store_exporters if request.store else self._exporters
        for exporter in exporters:
            if exporter.transport in wanted and exporter.accepts(request.host_id):
                regions, session = exporter.describe()
                return kv_transfer_pb2.HandshakeResponse(
                    transport=exporter.transport, regions=[r.to_proto() for r in regions], mooncake_session=session)
        if GRPC in wanted and self._serve_grpc:
            return kv_transfer_pb2.HandshakeResponse(transport=GRPC)
        offered = [e.transport for e in exporters] + ([GRPC] if self._serve_grpc else [])
        raise Incompatible(f"no KV transport in common: consumer reads with {sorted(wanted)}, producer offers {offered}")

    def Open(self, request, context):
        with tracer().start_as_current_span("kv.open") as span:
            try:
                transfer, exported = self._open_transfer(request)
                if self._block_checksums is None and not exported:
                    raise InvalidRequest("this producer serves its blocks over gRPC only")
            except PDMeshError as exc:
                span.record_exception(exc)
                self._abort(context, exc)
            span.set_attribute("pdmesh.kv.blocks", len(request.block_indexes))
            return self._opened(transfer, list(request.block_indexes), request.transport)

    def _opened(self, transfer: HeldTransfer, indexes: list[int], transport: str) -> kv_transfer_pb2.OpenResponse:
        """The producer's block ids, checksums and content hashes of the transfer's blocks at
        `indexes`, counted as sent by `transport` (gRPC layer reads counted their bytes as they went)."""
        block_ids = [transfer.block_ids[i] for i in indexes]
        checksums = self._checksums(transfer, indexes, block_ids)
        num_bytes = 0 if transport == GRPC else len(block_ids) * self._compat.block_nbytes
        self._count(len(block_ids), num_bytes, transport or "unknown")
        return kv_transfer_pb2.OpenResponse(block_ids=block_ids, checksums=checksums,
                                            block_hashes=[transfer.block_hashes[i] for i in indexes])

    def Pull(self, request, context):
        if request.end_layer:
            yield from self._pull_layers(request, context)
            return
        timing = PullTiming(logger, "served", request.transfer_id, context.peer())
        outcome = "stopped (the reader went away)"
        with tracer().start_as_current_span("kv.serve") as span:
            span.set_attribute("pdmesh.kv.transfer_id", request.transfer_id)
            try:
                transfer, exported = self._open_transfer(request)
                if exported and not self._store.lease(request.transfer_id):  # its slots stay its own while streamed
                    raise TransferNotFound(f"KV store export {request.transfer_id!r} expired")
                timing.opened()
            except PDMeshError as exc:
                span.record_exception(exc)
                timing.end(f"refused: {exc}")
                self._abort(context, exc)
            try:
                num_bytes = yield from self._stream(transfer, exported, list(request.block_indexes), timing)
                outcome = "sent"
            finally:
                if exported:
                    self._store.unlease(request.transfer_id)
                timing.end(outcome)
            span.set_attributes({"pdmesh.kv.blocks": len(request.block_indexes), "pdmesh.kv.bytes": num_bytes})

    def _pull_layers(self, request: kv_transfer_pb2.PullRequest, context):
        """Layer-wise flow over gRPC: layers [first_layer, end_layer) of blocks of a transfer that may
        still be prefilling (what was written of them; the held answer's checksums catch the rest)."""
        try:
            check_readable(self._compat, request.compat)
            if self._progress is None or self._read_layers is None:
                raise InvalidRequest("this producer has no layer-wise transfers")
            if not 0 <= request.first_layer < request.end_layer <= self._compat.num_layers:
                raise InvalidRequest(f"layers [{request.first_layer}, {request.end_layer}) outside "
                                     f"[0, {self._compat.num_layers})")
            block_ids = self._progress.block_ids(request.transfer_id, list(request.block_indexes))
        except PDMeshError as exc:
            self._abort(context, exc)
        rows = self._read_layers(block_ids, range(request.first_layer, request.end_layer))
        layers = range(request.first_layer, request.end_layer)
        yield from iter_chunks(list(request.block_indexes), rows, [b""] * len(block_ids), self._chunk_nbytes,
                               pieces_of(self._layer_pieces, layers))
        self._count(0, rows.nbytes, GRPC)

    def _stream(self, transfer: HeldTransfer, exported: bool, indexes: list[int], timing: PullTiming):
        """Yields the chunks of the transfer's blocks at `indexes` (each timed once taken); returns
        the bytes sent."""
        read_run, read_rows = ((lambda ids: self._store.read_rows(ids).tobytes(), self._store.read_rows)
                               if exported else (self._read_run, self._read_blocks))
        num_bytes = 0
        per_read = blocks_per_chunk(self._compat.block_nbytes, self._chunk_nbytes)
        for start in range(0, len(indexes), per_read):
            batch = indexes[start:start + per_read]
            block_ids = [transfer.block_ids[i] for i in batch]
            hashes = [transfer.block_hashes[i] for i in batch]
            if per_read > 1 and read_run is not None:  # a message's bytes straight from the cache
                chunk = run_chunk(batch, read_run(block_ids), self._compat.block_nbytes, hashes,
                                  pieces_of(self._layer_pieces))
                yield chunk
                timing.message()
                nbytes = len(chunk.data)
            else:
                rows = read_rows(block_ids)  # one gather per layer
                for chunk in iter_chunks(batch, rows, hashes, self._chunk_nbytes, pieces_of(self._layer_pieces)):
                    yield chunk
                    timing.message()
                nbytes = rows.nbytes
            num_bytes += nbytes
            self._count(len(batch), nbytes, GRPC)
        return num_bytes

    def Watch(self, request, context):
        try:
            check_readable(self._compat, request.compat)
            if self._progress is None:
                raise InvalidRequest("this producer has no layer-wise transfers")
            answer, written = self._progress.watch_written(request.transfer_id, request.seen_version,
                                                           min(max(request.wait_ms, 0), MAX_WATCH_MS) / 1000)
            if answer.held:  # what an Open would answer, in this same call (written, or held)
                if written is not None:
                    _check_indexes(request.transfer_id, written, request.block_indexes)
                transfer = written if written is not None else self._open_transfer(request)[0]
                opened = self._opened(transfer, list(request.block_indexes), request.transport)
                answer.checksums[:], answer.block_hashes[:] = opened.checksums, opened.block_hashes
            return answer
        except PDMeshError as exc:
            self._abort(context, exc)

    def Release(self, request, context):
        if self._store is not None and self._store.release(request.transfer_id):
            return kv_transfer_pb2.ReleaseResponse(released=True)
        return kv_transfer_pb2.ReleaseResponse(released=self._held.release(request.transfer_id))

    def _checksums(self, transfer: HeldTransfer, block_indexes, block_ids: list[int]) -> list[int]:
        if transfer.checksums is None:
            return self._block_checksums(block_ids)
        every = transfer.checksums.result(timeout=self._wait_timeout_s)
        return [every[i] for i in block_indexes]

    def _count(self, num_blocks: int, num_bytes: int, transport: str) -> None:
        with self._lock:
            self.num_blocks_sent += num_blocks
            self.num_bytes_sent += num_bytes
            self.bytes_sent_by_transport[transport] = self.bytes_sent_by_transport.get(transport, 0) + num_bytes

    @staticmethod
    def _abort(context, exc: PDMeshError) -> None:
        context.set_trailing_metadata(error_metadata(exc))
        context.abort(grpc_status_of(exc), str(exc))

    def _open_transfer(self, request) -> tuple[HeldTransfer, bool]:
        """(the transfer, whether it is a KV store export)."""
        transfer = self._store.find(request.transfer_id) if self._store is not None else None
        exported = transfer is not None
        (check_compatible if exported else check_readable)(self._compat, request.compat)
        if transfer is None and self._store is not None and self._store.ended(request.transfer_id):
            raise TransferNotFound(f"KV store export {request.transfer_id!r} was released or expired")
        if transfer is None:
            transfer = self._held.wait_for(request.transfer_id, self._wait_timeout_s)
        _check_indexes(request.transfer_id, transfer, request.block_indexes)
        return transfer, exported


def _check_indexes(transfer_id: str, transfer: HeldTransfer, block_indexes) -> None:
    num_blocks = len(transfer.block_ids)
    bad = [i for i in block_indexes if not 0 <= i < num_blocks]
    if bad:
        raise InvalidRequest(f"transfer {transfer_id}: block indexes {bad} outside [0, {num_blocks})")


@dataclass(frozen=True)
class ExtraService:
    """Another service served on the same port (the node's KV store)."""

    full_name: str
    add_to_server: Callable[[object, grpc.Server], None]
    servicer: object


class GrpcKVServer:
    """Owns the server; `address` is host:port actually bound."""

    def __init__(self, servicer: KVTransferServicer, host: str, port: int,
                 extra_services: Sequence[ExtraService] = (), auth: MeshAuth | None = None,
                 budgets: Sequence[RpcBudget] = KV_PORT_BUDGETS) -> None:
        auth = auth or MeshAuth()
        interceptors = [MeshTokenInterceptor(auth.token)] if auth.token else []
        self._budgets = RpcBudgetInterceptor(budgets)
        threads = threads_for(budgets, FREE_THREADS)
        # calls waiting for a thread: at most as many again, then RESOURCE_EXHAUSTED without queueing
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="pdmesh-kv-port"),
                                   options=GRPC_OPTIONS, maximum_concurrent_rpcs=2 * threads,
                                   interceptors=[*interceptors, self._budgets, RejectMalformedRequestsSync(),
                                                 server_interceptor()])
        kv_transfer_pb2_grpc.add_KVTransferServicer_to_server(servicer, self._server)
        for extra in extra_services:
            extra.add_to_server(extra.servicer, self._server)
        self._add_health_and_reflection([extra.full_name for extra in extra_services])
        credentials = server_credentials(auth.tls)
        bound_port = (self._server.add_secure_port(f"{host}:{port}", credentials) if credentials is not None
                      else self._server.add_insecure_port(f"{host}:{port}"))
        if bound_port == 0:
            raise OSError(f"KV transfer server could not bind {host}:{port}")
        self._address = f"{host}:{bound_port}"
        self._server.start()

    @property
    def address(self) -> str:
        return self._address

    @property
    def num_refused_busy(self) -> int:
        """Calls answered RESOURCE_EXHAUSTED because their method's budget was in use."""
        return sum(self._budgets.num_refused.values())

    def stop(self, grace_s: float = 1.0) -> None:
        self._server.stop(grace_s).wait()

    def _add_health_and_reflection(self, extra_names: list[str]) -> None:
        health_servicer = health.HealthServicer()
        health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, self._server)
        names = (kv_transfer_pb2.DESCRIPTOR.services_by_name["KVTransfer"].full_name, *extra_names,
                 health.SERVICE_NAME, reflection.SERVICE_NAME)
        reflection.enable_server_reflection(names, self._server)

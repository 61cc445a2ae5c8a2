"""The consumer's client of a producer's KV port: handshake, open, release (the control path of
every transport) and the gRPC transport's streamed pull."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence

import grpc

from pdmesh.kv.checksum import pieces_of
from pdmesh.kv.kv_layout import LayerRegion
from pdmesh.status_map import error_from_rpc_error
from pdmesh.transport.channels import ChannelCache
from pdmesh.transport.chunking import AssembledBlock, receive_runs
from pdmesh.transport.kv_transport import PeerLink
from pdmesh.transport.mesh_auth import MeshAuth
from pdmesh.transport.pull_timing import PullTiming
from pdmesh.v1 import common_pb2, kv_transfer_pb2, kv_transfer_pb2_grpc

logger = logging.getLogger(__name__)
RELEASE_WAIT_S = 1.0  # how long a transfer thread waits for a Release's answer before going on without it


class KVPortClient:
    def __init__(self, compat: common_pb2.CompatInfo, timeout_s: float = 30.0, auth: MeshAuth | None = None,
                 layer_pieces: Sequence[Sequence[int]] | None = None) -> None:
        """layer_pieces: each layer's piece sizes in the producer's blocks, which the gRPC pull's
        checksums cover (pdmesh/kv/checksum.py; None: a block is one piece, on both ends)."""
        auth = auth or MeshAuth()
        self._compat = compat
        self._layer_pieces = layer_pieces
        self._timeout_s = timeout_s
        self._metadata = auth.metadata()
        self._channels = ChannelCache(auth.tls)
        self._lock = threading.Lock()
        self._releases: set[grpc.Future] = set()   # sent with release_soon, not answered yet

    @property
    def block_nbytes(self) -> int:
        return self._compat.block_nbytes

    def handshake(self, address: str, transports: Sequence[str], host_id: str, store: bool = False) -> PeerLink:
        """store: a link to the node's KV store exports (kvstore/store_export.py), not its KV cache."""
        request = kv_transfer_pb2.HandshakeRequest(compat=self._compat, transports=list(transports), host_id=host_id,
                                                   store=store)
        response = self._call(self._stub(address).Handshake, request)
        return PeerLink(address, response.transport, tuple(LayerRegion.from_proto(r) for r in response.regions),
                        response.mooncake_session)

    def open(self, address: str, transfer_id: str, block_indexes: Sequence[int],
             transport: str) -> kv_transfer_pb2.OpenResponse:
        return self.open_soon(address, transfer_id, block_indexes, transport)()

    def open_soon(self, address: str, transfer_id: str, block_indexes: Sequence[int],
                  transport: str) -> Callable[[], kv_transfer_pb2.OpenResponse]:
        """Sends the Open; the returned call waits for its answer (work can happen in between)."""
        request = kv_transfer_pb2.OpenRequest(transfer_id=transfer_id, block_indexes=list(block_indexes),
                                              compat=self._compat, transport=transport)
        future = self._stub(address).Open.future(request, timeout=self._timeout_s, metadata=self._metadata)

        def answer() -> kv_transfer_pb2.OpenResponse:
            try:
                return future.result()
            except grpc.RpcError as exc:
                raise error_from_rpc_error(exc) from exc

        return answer

    def pull(self, address: str, transfer_id: str, block_indexes: Sequence[int],
             verify: bool = True, tamper=None) -> Iterator[AssembledBlock]:
        """Yields verified blocks in the order asked; raises a domain error on any failure."""
        for blocks in self.pull_runs(address, transfer_id, block_indexes, verify, tamper):
            yield from blocks

    def pull_runs(self, address: str, transfer_id: str, block_indexes: Sequence[int],
                  verify: bool = True, tamper=None, layers: range | None = None) -> Iterator[list[AssembledBlock]]:
        """pull, a message's worth of blocks at a time (chunking.rows_of gives their rows); with
        `layers`, only those layers of each block (layer-wise flow: no content hashes)."""
        request = kv_transfer_pb2.PullRequest(
            transfer_id=transfer_id, block_indexes=list(block_indexes), compat=self._compat,
            first_layer=layers.start if layers else 0, end_layer=layers.stop if layers else 0)
        timing = PullTiming(logger, "pulled", transfer_id, address)
        chunks = self._stub(address).Pull(request, timeout=self._timeout_s, metadata=self._metadata)
        outcome = "stopped (the reader went away)"
        try:
            yield from receive_runs(_timed(chunks, timing), self._compat.block_nbytes, len(block_indexes),
                                    f"transfer {transfer_id}", verify=verify, tamper=tamper,
                                    piece_nbytes=pieces_of(self._layer_pieces, layers))
            outcome = "received"
        except Exception as exc:
            outcome = f"failed: {exc}"
            raise
        finally:
            timing.end(outcome)

    def watch(self, address: str, transfer_id: str, seen_version: int, wait_s: float,
              block_indexes: Sequence[int] = (), transport: str = "") -> kv_transfer_pb2.WatchResponse:
        """A transfer still being prefilled: its progress past seen_version (layer-wise flow); once
        held, also what an Open of block_indexes answers."""
        request = kv_transfer_pb2.WatchRequest(transfer_id=transfer_id, compat=self._compat,
                                               seen_version=seen_version, wait_ms=int(wait_s * 1000),
                                               block_indexes=list(block_indexes), transport=transport)
        try:
            return self._stub(address).Watch(request, timeout=wait_s + self._timeout_s, metadata=self._metadata)
        except grpc.RpcError as exc:
            raise error_from_rpc_error(exc) from exc

    def release(self, address: str, transfer_id: str) -> bool:
        """The Release, waited for: whether the producer held the transfer."""
        return self._call(self._stub(address).Release, kv_transfer_pb2.ReleaseRequest(transfer_id=transfer_id)).released

    def release_soon(self, address: str, transfer_id: str) -> grpc.Future:
        """Sends the Release and returns without its answer (wait_briefly waits a moment for it): a
        producer frees what is not released at its deadline anyway, and an unanswered Release once
        held both of a worker's transfer threads for the whole timeout, and with them every load on
        that worker (a 30 s stall in the soak). A failure is logged."""
        future = self._stub(address).Release.future(kv_transfer_pb2.ReleaseRequest(transfer_id=transfer_id),
                                                    timeout=self._timeout_s, metadata=self._metadata)
        with self._lock:
            self._releases.add(future)   # gRPC cancels a call whose future is garbage-collected
        future.add_done_callback(lambda call: self._released(call, address, transfer_id))
        return future

    def _released(self, call: grpc.Future, address: str, transfer_id: str) -> None:
        with self._lock:
            self._releases.discard(call)
        _log_if_failed(call, address, transfer_id)

    def close(self) -> None:
        self._channels.close()

    def _call(self, method, request):
        try:
            return method(request, timeout=self._timeout_s, metadata=self._metadata)
        except grpc.RpcError as exc:
            raise error_from_rpc_error(exc) from exc

    def _stub(self, address: str) -> kv_transfer_pb2_grpc.KVTransferStub:
        return kv_transfer_pb2_grpc.KVTransferStub(self._channels.get(address))


def _timed(chunks: Iterable[kv_transfer_pb2.KVChunk], timing: PullTiming) -> Iterator[kv_transfer_pb2.KVChunk]:
    for chunk in chunks:
        timing.message()
        yield chunk


def wait_briefly(releases: Iterable[grpc.Future | None], timeout_s: float = RELEASE_WAIT_S) -> None:
    """Waits up to timeout_s in all for the answers of releases sent with release_soon (None: none
    was sent), whatever they are (a failure was logged)."""
    deadline = time.monotonic() + timeout_s
    for release in releases:
        if release is not None:
            with contextlib.suppress(Exception):   # a timeout, or the failure already logged
                release.result(timeout=max(0.0, deadline - time.monotonic()))


def _log_if_failed(call: grpc.Future, address: str, transfer_id: str) -> None:
    if call.cancelled():   # the channel closed (shutdown)
        return
    error = call.exception()
    if error is not None:
        logger.warning("transfer %s on %s: release failed (%s); freed at its deadline", transfer_id, address,
                       error_from_rpc_error(error))

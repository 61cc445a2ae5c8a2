"""Consumer side of the gRPC KV transfer: pulls chunked blocks and verifies each checksum."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence

import grpc
from opentelemetry.instrumentation.grpc import client_interceptor
from opentelemetry.instrumentation.grpc.grpcext import intercept_channel

from pdmesh.errors import WorkerFailed
from pdmesh.status_map import error_from_rpc_error
from pdmesh.transport.chunking import AssembledBlock, BlockAssembler
from pdmesh.transport.grpc_options import GRPC_OPTIONS
from pdmesh.v1 import common_pb2, kv_transfer_pb2, kv_transfer_pb2_grpc


class GrpcKVReceiver:
    def __init__(self, compat: common_pb2.CompatInfo, timeout_s: float = 30.0) -> None:
        self._compat = compat
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._channels: dict[str, tuple[grpc.Channel, grpc.Channel]] = {}  # address: (raw, traced)

    def pull(self, address: str, transfer_id: str, block_indexes: Sequence[int]) -> Iterator[AssembledBlock]:
        """Yields verified blocks in the order asked; raises a domain error on any failure."""
        request = kv_transfer_pb2.PullRequest(
            transfer_id=transfer_id, block_indexes=list(block_indexes), compat=self._compat)
        assembler = BlockAssembler(max_block_nbytes=self._compat.block_nbytes)
        num_blocks = 0
        try:
            for chunk in self._stub(address).Pull(request, timeout=self._timeout_s):
                block = assembler.add(chunk)
                if block is not None:
                    num_blocks += 1
                    yield block
        except grpc.RpcError as exc:
            raise error_from_rpc_error(exc) from exc
        if num_blocks != len(block_indexes) or assembler.in_progress:
            raise WorkerFailed(f"transfer {transfer_id}: got {num_blocks} of {len(block_indexes)} blocks")

    def release(self, address: str, transfer_id: str) -> None:
        try:
            self._stub(address).Release(kv_transfer_pb2.ReleaseRequest(transfer_id=transfer_id),
                                        timeout=self._timeout_s)
        except grpc.RpcError as exc:
            raise error_from_rpc_error(exc) from exc

    def close(self) -> None:
        with self._lock:
            for channel, _ in self._channels.values():
                channel.close()
            self._channels.clear()

    def _stub(self, address: str) -> kv_transfer_pb2_grpc.KVTransferStub:
        with self._lock:
            if address not in self._channels:
                channel = grpc.insecure_channel(address, options=GRPC_OPTIONS)
                self._channels[address] = (channel, intercept_channel(channel, client_interceptor()))
            traced = self._channels[address][1]
        return kv_transfer_pb2_grpc.KVTransferStub(traced)

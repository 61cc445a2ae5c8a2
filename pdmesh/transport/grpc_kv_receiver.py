"""Consumer side of the gRPC KV transfer: pulls chunked blocks and verifies each checksum."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import grpc

from pdmesh.status_map import error_from_rpc_error
from pdmesh.transport.channels import ChannelCache
from pdmesh.transport.chunking import AssembledBlock, receive_runs
from pdmesh.v1 import common_pb2, kv_transfer_pb2, kv_transfer_pb2_grpc


class GrpcKVReceiver:
    def __init__(self, compat: common_pb2.CompatInfo, timeout_s: float = 30.0) -> None:
        self._compat = compat
        self._timeout_s = timeout_s
        self._channels = ChannelCache()

    def pull(self, address: str, transfer_id: str, block_indexes: Sequence[int]) -> Iterator[AssembledBlock]:
        """Yields verified blocks in the order asked; raises a domain error on any failure."""
        for blocks in self.pull_runs(address, transfer_id, block_indexes):
            yield from blocks

    def pull_runs(self, address: str, transfer_id: str,
                  block_indexes: Sequence[int]) -> Iterator[list[AssembledBlock]]:
        """pull, a message's worth of blocks at a time (chunking.rows_of gives their rows)."""
        request = kv_transfer_pb2.PullRequest(
            transfer_id=transfer_id, block_indexes=list(block_indexes), compat=self._compat)
        chunks = self._stub(address).Pull(request, timeout=self._timeout_s)
        yield from receive_runs(chunks, self._compat.block_nbytes, len(block_indexes), f"transfer {transfer_id}")

    def release(self, address: str, transfer_id: str) -> None:
        try:
            self._stub(address).Release(kv_transfer_pb2.ReleaseRequest(transfer_id=transfer_id),
                                        timeout=self._timeout_s)
        except grpc.RpcError as exc:
            raise error_from_rpc_error(exc) from exc

    def close(self) -> None:
        self._channels.close()

    def _stub(self, address: str) -> kv_transfer_pb2_grpc.KVTransferStub:
        return kv_transfer_pb2_grpc.KVTransferStub(self._channels.get(address))

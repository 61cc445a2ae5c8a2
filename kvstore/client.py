"""Client of other nodes' (and the local engine's) KVStore service."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import grpc

from kvstore.block_key import BlockKey
from kvstore.prefix_lookup import BlockSource
from kvstore.service import ref_of
from pdmesh.status_map import error_from_rpc_error
from pdmesh.transport.channels import ChannelCache
from pdmesh.transport.mesh_auth import MeshAuth
from pdmesh.v1 import common_pb2, kv_store_pb2, kv_store_pb2_grpc


class GrpcStoreClient:
    def __init__(self, compat: common_pb2.CompatInfo | None, timeout_s: float = 30.0,
                 auth: MeshAuth | None = None) -> None:
        """compat None: only for the engine's own scheduler asking its own worker (Lookup)."""
        auth = auth or MeshAuth()
        self._compat = compat
        self._timeout_s = timeout_s
        self._metadata = auth.metadata()
        self._channels = ChannelCache(auth.tls)

    def lookup(self, address: str, token_ids: Sequence[int], extra_key: bytes = b"",
               include_remote: bool = True, timeout_s: float | None = None,
               block_hashes: Sequence[bytes] = ()) -> list[BlockSource]:
        """block_hashes: the names of token_ids' full blocks, when the caller has them (else named there)."""
        request = kv_store_pb2.LookupRequest(compat=self._compat, token_ids=list(token_ids), extra_key=extra_key,
                                             include_remote=include_remote, block_hashes=list(block_hashes))
        try:
            response = self._stub(address).Lookup(request, timeout=timeout_s or self._timeout_s,
                                                   metadata=self._metadata)
        except grpc.RpcError as exc:
            raise error_from_rpc_error(exc) from exc
        return [BlockSource(block.node, block.tier) for block in response.blocks]

    def export(self, address: str, keys: Sequence[BlockKey]) -> tuple[str, int]:
        """(transfer id, number of leading blocks exported): the node holds them for a KV read
        (pdmesh/transport/kv_transport.py) until released on its KV port."""
        return self.export_soon(address, keys)()

    def export_soon(self, address: str, keys: Sequence[BlockKey]) -> Callable[[], tuple[str, int]]:
        """Sends the Export; the returned call waits for its answer (a read can run meanwhile)."""
        request = kv_store_pb2.ExportRequest(compat=self._compat, blocks=[ref_of(key) for key in keys])
        future = self._stub(address).Export.future(request, timeout=self._timeout_s, metadata=self._metadata)

        def answer() -> tuple[str, int]:
            try:
                response = future.result()
            except grpc.RpcError as exc:
                raise error_from_rpc_error(exc) from exc
            return response.transfer_id, response.num_blocks

        return answer

    def close(self) -> None:
        self._channels.close()

    def _stub(self, address: str) -> kv_store_pb2_grpc.KVStoreStub:
        return kv_store_pb2_grpc.KVStoreStub(self._channels.get(address))

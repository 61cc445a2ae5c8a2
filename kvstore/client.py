"""Client of other nodes' (and the local engine's) KVStore service."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import grpc

from kvstore.block_key import BlockKey
from kvstore.prefix_lookup import BlockSource
from kvstore.service import ref_of
from pdmesh.status_map import error_from_rpc_error
from pdmesh.transport.channels import ChannelCache
from pdmesh.transport.chunking import AssembledBlock, receive_runs
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
               include_remote: bool = True, timeout_s: float | None = None) -> list[BlockSource]:
        request = kv_store_pb2.LookupRequest(compat=self._compat, token_ids=list(token_ids), extra_key=extra_key,
                                             include_remote=include_remote)
        try:
            response = self._stub(address).Lookup(request, timeout=timeout_s or self._timeout_s,
                                                   metadata=self._metadata)
        except grpc.RpcError as exc:
            raise error_from_rpc_error(exc) from exc
        return [BlockSource(block.node, block.tier) for block in response.blocks]

    def fetch(self, address: str, keys: Sequence[BlockKey]) -> Iterator[AssembledBlock]:
        """Verified blocks in the order asked (block_index = position in `keys`); raises a domain
        error at the first block the node does not hold, after the ones before it."""
        for blocks in self.fetch_runs(address, keys):
            yield from blocks

    def fetch_runs(self, address: str, keys: Sequence[BlockKey]) -> Iterator[list[AssembledBlock]]:
        """fetch, a message's worth of blocks at a time (chunking.rows_of gives their rows)."""
        request = kv_store_pb2.FetchRequest(compat=self._compat, blocks=[ref_of(key) for key in keys])
        chunks = self._stub(address).Fetch(request, timeout=self._timeout_s, metadata=self._metadata)
        yield from receive_runs(chunks, self._compat.block_nbytes, len(keys), f"fetch from {address}")

    def close(self) -> None:
        self._channels.close()

    def _stub(self, address: str) -> kv_store_pb2_grpc.KVStoreStub:
        return kv_store_pb2_grpc.KVStoreStub(self._channels.get(address))

"""gRPC face of a node's block store (runs in the prefill engine's worker process, on the same
thread-pool server as KVTransfer): Lookup for the local scheduler, Export for other nodes (which
then read the exported blocks through KVTransfer, like a prefill's KV)."""

from __future__ import annotations

from opentelemetry import trace

from kvstore.block_key import BlockKey, block_keys, keys_of
from kvstore.block_store import TieredBlockStore
from kvstore.prefix_lookup import find_prefix
from kvstore.redis_index import RedisBlockIndex
from pdmesh.compat import check_compatible, fingerprint_seed
from kvstore.store_export import StoreExports
from pdmesh.errors import Incompatible, PDMeshError
from pdmesh.status_map import error_metadata, grpc_status_of
from pdmesh.telemetry.tracing import tracer
from pdmesh.v1 import common_pb2, kv_store_pb2, kv_store_pb2_grpc

SERVICE_NAME = kv_store_pb2.DESCRIPTOR.services_by_name["KVStore"].full_name


class KVStoreServicer(kv_store_pb2_grpc.KVStoreServicer):
    def __init__(self, compat: common_pb2.CompatInfo, store: TieredBlockStore, index: RedisBlockIndex | None,
                 exports: StoreExports | None = None) -> None:
        self._compat = compat
        self._seed = fingerprint_seed(compat)
        self._store = store
        self._index = index
        self._exports = exports

    def Lookup(self, request, context):
        try:
            if request.HasField("compat"):  # the engine's own scheduler sends none
                check_compatible(self._compat, request.compat)
        except PDMeshError as exc:
            _abort(context, exc)
        block_size = self._compat.block_size
        keys = (keys_of(list(request.block_hashes), request.token_ids, block_size) if request.block_hashes
                else block_keys(self._seed, request.token_ids, block_size, request.extra_key))
        sources = find_prefix(self._store, self._index, keys, request.include_remote)
        return kv_store_pb2.LookupResponse(
            blocks=[kv_store_pb2.BlockSource(node=s.node, tier=s.tier) for s in sources])

    def Export(self, request, context):
        with tracer().start_as_current_span("kvstore.export") as span:
            try:
                check_compatible(self._compat, request.compat)
                if self._exports is None:
                    raise Incompatible("this node's KV store exports no blocks")
                exported = self._exports.export([key_of(ref) for ref in request.blocks])
                if exported.transfer is not None and not context.is_active():  # the caller gave up meanwhile
                    self._exports.release(exported.transfer.transfer_id)
            except PDMeshError as exc:
                span.record_exception(exc)
                span.set_status(trace.Status(trace.StatusCode.ERROR, str(exc)))
                _abort(context, exc)
            for tier in exported.tiers:
                span.add_event("block", {"pdmesh.kvstore.tier": tier})
            num_blocks = len(exported.tiers)
            span.set_attributes({"pdmesh.kv.blocks": num_blocks,
                                 "pdmesh.kv.bytes": num_blocks * self._compat.block_nbytes})
            return kv_store_pb2.ExportResponse(
                transfer_id=exported.transfer.transfer_id if exported.transfer else "", num_blocks=num_blocks)


def ref_of(key: BlockKey) -> kv_store_pb2.BlockRef:
    return kv_store_pb2.BlockRef(block_hash=key.block_hash, parent_hash=key.parent_hash, token_ids=key.token_ids)


def key_of(ref: kv_store_pb2.BlockRef) -> BlockKey:
    return BlockKey(bytes(ref.block_hash), bytes(ref.parent_hash), tuple(ref.token_ids))


def _abort(context, exc: PDMeshError) -> None:
    context.set_trailing_metadata(error_metadata(exc))
    context.abort(grpc_status_of(exc), str(exc))

"""gRPC face of a node's block store (runs in the prefill engine's worker process, on the same
thread-pool server as KVTransfer): Lookup for the local scheduler, Fetch for other nodes."""

from __future__ import annotations

from opentelemetry import trace

from kvstore.block_key import BlockKey, block_keys
from kvstore.block_store import TieredBlockStore
from kvstore.prefix_lookup import find_prefix
from kvstore.redis_index import RedisBlockIndex
from pdmesh.compat import check_compatible, fingerprint_seed
from pdmesh.errors import PDMeshError, TransferNotFound
from pdmesh.status_map import error_metadata, grpc_status_of
from pdmesh.telemetry.tracing import tracer
from pdmesh.transport.chunking import DEFAULT_CHUNK_NBYTES, iter_chunks
from pdmesh.v1 import common_pb2, kv_store_pb2, kv_store_pb2_grpc

FETCH_BATCH_BLOCKS = 16  # blocks read from the store per batch (one copy per tier)
SERVICE_NAME = kv_store_pb2.DESCRIPTOR.services_by_name["KVStore"].full_name


class KVStoreServicer(kv_store_pb2_grpc.KVStoreServicer):
    def __init__(self, compat: common_pb2.CompatInfo, store: TieredBlockStore, index: RedisBlockIndex | None,
                 chunk_nbytes: int = DEFAULT_CHUNK_NBYTES) -> None:
        self._compat = compat
        self._seed = fingerprint_seed(compat)
        self._store = store
        self._index = index
        self._chunk_nbytes = chunk_nbytes

    def Lookup(self, request, context):
        try:
            if request.HasField("compat"):  # the engine's own scheduler sends none
                check_compatible(self._compat, request.compat)
        except PDMeshError as exc:
            _abort(context, exc)
        keys = block_keys(self._seed, request.token_ids, self._compat.block_size, request.extra_key)
        sources = find_prefix(self._store, self._index, keys, request.include_remote)
        return kv_store_pb2.LookupResponse(
            blocks=[kv_store_pb2.BlockSource(node=s.node, tier=s.tier) for s in sources])

    def Fetch(self, request, context):
        with tracer().start_as_current_span("kvstore.serve") as span:
            num_bytes = 0
            try:
                check_compatible(self._compat, request.compat)
                keys = [key_of(ref) for ref in request.blocks]
                for start in range(0, len(keys), FETCH_BATCH_BLOCKS):
                    batch = keys[start:start + FETCH_BATCH_BLOCKS]
                    rows, tiers = self._store.read_prefix(batch)
                    for tier in tiers:
                        span.add_event("block", {"pdmesh.kvstore.tier": tier})
                    yield from iter_chunks(list(range(start, start + len(tiers))), rows,
                                           [key.block_hash for key in batch[:len(tiers)]], self._chunk_nbytes)
                    num_bytes += rows.nbytes
                    if len(tiers) < len(batch):
                        raise TransferNotFound(f"block {batch[len(tiers)].block_hash.hex()} is not held here")
            except PDMeshError as exc:
                span.record_exception(exc)
                span.set_status(trace.Status(trace.StatusCode.ERROR, str(exc)))
                _abort(context, exc)
            finally:
                span.set_attributes({"pdmesh.kv.blocks": len(request.blocks), "pdmesh.kv.bytes": num_bytes})


def ref_of(key: BlockKey) -> kv_store_pb2.BlockRef:
    return kv_store_pb2.BlockRef(block_hash=key.block_hash, parent_hash=key.parent_hash, token_ids=key.token_ids)


def key_of(ref: kv_store_pb2.BlockRef) -> BlockKey:
    return BlockKey(bytes(ref.block_hash), bytes(ref.parent_hash), tuple(ref.token_ids))


def _abort(context, exc: PDMeshError) -> None:
    context.set_trailing_metadata(error_metadata(exc))
    context.abort(grpc_status_of(exc), str(exc))

"""Two nodes' stores over real gRPC sharing a real Redis index: lookup local then remote; a node
exports blocks to another, which reads them as a KV transfer on the node's KV port."""

from __future__ import annotations

import dataclasses

import pytest

from decode.kv.kv_port_client import KVPortClient
from kvstore.block_store import TieredBlockStore
from kvstore.client import GrpcStoreClient
from kvstore.prefix_lookup import BlockSource
from kvstore.redis_index import RedisBlockIndex
from kvstore.service import SERVICE_NAME, KVStoreServicer
from kvstore.slab_tier import host_tier
from kvstore.store_export import StoreExports
from pdmesh.errors import Incompatible, Overloaded
from pdmesh.v1 import common_pb2, kv_store_pb2_grpc
from prefill.kv.grpc_kv_server import ExtraService, GrpcKVServer, KVTransferServicer
from prefill.kv.held_transfers import HeldTransfers
from tests.kvstore.factories import BLOCK_NBYTES, BLOCK_SIZE, SEED, keys, payload

COMPAT = common_pb2.CompatInfo(model_fingerprint=SEED.decode(), dtype="float32", block_size=BLOCK_SIZE,
                               layout="test", num_layers=1, block_nbytes=BLOCK_NBYTES)


class _Node:
    def __init__(self, redis_server) -> None:
        self.store = TieredBlockStore([host_tier(8 * BLOCK_NBYTES, BLOCK_NBYTES)], BLOCK_NBYTES)
        self.exports = StoreExports(self.store, [(1, BLOCK_NBYTES)], 3 * BLOCK_NBYTES, hold_s=60)
        servicer = KVStoreServicer(COMPAT, self.store, index=None, exports=self.exports)
        self.server = GrpcKVServer(
            KVTransferServicer(COMPAT, HeldTransfers(), lambda block_ids: None, wait_timeout_s=0.2,
                               store=self.exports), "127.0.0.1", 0,
            extra_services=[ExtraService(SERVICE_NAME, kv_store_pb2_grpc.add_KVStoreServicer_to_server, servicer)])
        self.index = RedisBlockIndex.connect(redis_server.url, redis_server.password, SEED.decode(),
                                             self.server.address, ttl_s=60)
        servicer._index = self.index
        self.store.set_listener(self.index)

    def stop(self) -> None:
        assert self.exports.num_held == 0
        self.server.stop(0)
        self.exports.close()
        self.index.close()


@pytest.fixture
def nodes(redis_server, no_thread_leak):
    a, b = _Node(redis_server), _Node(redis_server)
    client = GrpcStoreClient(COMPAT, timeout_s=5)
    yield a, b, client
    client.close()
    a.stop()
    b.stop()


def _tokens(num_blocks: int) -> list[int]:
    return list(range(num_blocks * BLOCK_SIZE))


def test_lookup_finds_local_blocks_then_the_ones_another_node_holds(nodes):
    a, b, client = nodes
    k = keys(4)
    for i in (0, 1, 2):
        a.store.put(k[i], payload(i))
    b.store.put(k[0], payload(0))
    assert client.lookup(b.server.address, _tokens(4)) == [
        BlockSource("", "dram"), BlockSource(a.server.address, "dram"), BlockSource(a.server.address, "dram")]
    assert client.lookup(b.server.address, _tokens(4), include_remote=False) == [BlockSource("", "dram")]
    assert client.lookup(b.server.address, _tokens(4), extra_key=b"tenant-b") == []


def test_an_export_holds_the_leading_blocks_held_until_released_on_the_kv_port(nodes):
    a, _, client = nodes
    k = keys(3)
    a.store.put(k[0], payload(10))
    a.store.put(k[1], payload(11))
    reader = KVPortClient(COMPAT, timeout_s=5)
    try:
        transfer_id, num_blocks = client.export(a.server.address, [k[0], k[2], k[1]])
        assert num_blocks == 1  # stops at the first block it lacks
        reader.release(a.server.address, transfer_id)
        transfer_id, num_blocks = client.export(a.server.address, k)
        assert num_blocks == 2
        blocks = list(reader.pull(a.server.address, transfer_id, [0, 1]))
        assert [(b.block_index, b.block_hash, bytes(b.payload)) for b in blocks] == [
            (0, k[0].block_hash, payload(10)), (1, k[1].block_hash, payload(11))]
        assert client.export(a.server.address, [k[2]]) == ("", 0)  # none held: no transfer
        with pytest.raises(Overloaded):  # 2 of its 3 slots are held
            client.export(a.server.address, k[:2])
        reader.release(a.server.address, transfer_id)
        assert client.export(a.server.address, k[:2])[1] == 2  # room again
    finally:
        for transfer_id in list(a.exports._held):
            reader.release(a.server.address, transfer_id)
        reader.close()


def test_a_peer_with_another_layout_is_refused(nodes):
    a, _, _ = nodes
    other = common_pb2.CompatInfo()
    other.CopyFrom(COMPAT)
    other.block_size = 8
    client = GrpcStoreClient(other, timeout_s=5)
    with pytest.raises(Incompatible, match="block_size"):
        client.lookup(a.server.address, _tokens(1))
    with pytest.raises(Incompatible):
        client.export(a.server.address, keys(1))
    client.close()


def test_an_export_being_pulled_does_not_expire_under_its_reader(nodes):
    """A gRPC pull streams the slots it reads: while it runs the export is leased, so no expiry can
    hand its slots to another export mid-stream."""
    a, _, client = nodes
    k = keys(2)
    a.store.put(k[0], payload(20))
    a.store.put(k[1], payload(21))
    transfer_id, _ = client.export(a.server.address, k)
    assert a.exports.lease(transfer_id)
    a.exports._hold_s = 0.0
    a.exports._held[transfer_id] = dataclasses.replace(a.exports._held[transfer_id], deadline=0.0)
    assert a.exports.find(transfer_id) is not None  # past its deadline, leased: still held
    a.exports.unlease(transfer_id)
    assert a.exports.find(transfer_id) is None and a.exports.ended(transfer_id)
    assert not a.exports.lease(transfer_id)

"""Real gRPC KV server and receiver over loopback, with an in-memory block source."""

import grpc
import pytest

from pdmesh.errors import ChecksumMismatch, Incompatible, InvalidRequest, TransferNotFound
from pdmesh.transport.chunking import iter_block_chunks
from pdmesh.transport.grpc_kv_receiver import GrpcKVReceiver
from pdmesh.transport.grpc_kv_server import GrpcKVServer, KVTransferServicer
from pdmesh.transport.held_transfers import HeldTransfer, HeldTransfers
from pdmesh.v1 import common_pb2

BLOCK_NBYTES = 3 * 1024 * 1024 + 5  # spans four 1 MiB chunks
COMPAT = common_pb2.CompatInfo(model_fingerprint="fp", dtype="float32", block_size=32, layout="l",
                               num_layers=4, block_nbytes=BLOCK_NBYTES)


def _block(block_id: int) -> memoryview:
    return memoryview(bytes([block_id % 256]) * BLOCK_NBYTES)


class _CorruptingServicer(KVTransferServicer):
    """Fault injection: flips one bit of the first chunk after the checksum was taken."""

    def Pull(self, request, context):
        for i, chunk in enumerate(super().Pull(request, context)):
            if i == 0:
                data = bytearray(chunk.data)
                data[10] ^= 0x04
                chunk.data = bytes(data)
            yield chunk


@pytest.fixture
def held():
    held = HeldTransfers()
    held.hold(HeldTransfer("t1", block_ids=(7, 3, 9), block_hashes=(b"h7", b"h3", b"h9"), deadline=1e18))
    return held


@pytest.fixture
def server(held, no_thread_leak):
    server = GrpcKVServer(KVTransferServicer(COMPAT, held, _block, wait_timeout_s=0.2), "127.0.0.1", 0)
    yield server
    server.stop(grace_s=0)


@pytest.fixture
def receiver():
    receiver = GrpcKVReceiver(COMPAT, timeout_s=10)
    yield receiver
    receiver.close()


def test_pull_streams_the_asked_blocks_in_order_and_release_frees_them(server, receiver, held):
    blocks = list(receiver.pull(server.address, "t1", [2, 0]))
    assert [b.block_index for b in blocks] == [2, 0]
    assert [b.block_hash for b in blocks] == [b"h9", b"h7"]
    assert bytes(blocks[0].payload) == bytes(_block(9)) and bytes(blocks[1].payload) == bytes(_block(7))
    receiver.release(server.address, "t1")
    assert held.take_finished() == {"t1"}


def test_mismatched_layout_fails_at_handshake_with_the_differing_fields(server):
    other = common_pb2.CompatInfo()
    other.CopyFrom(COMPAT)
    other.block_size = 64
    other.dtype = "bfloat16"
    receiver = GrpcKVReceiver(other)
    with pytest.raises(Incompatible, match=r"dtype: local='float32' peer='bfloat16'; block_size: local=32 peer=64"):
        list(receiver.pull(server.address, "t1", [0]))
    receiver.close()


def test_unknown_transfer_is_not_found(server, receiver):
    with pytest.raises(TransferNotFound, match="no KV held for transfer 'nope'"):
        list(receiver.pull(server.address, "nope", [0]))


def test_block_index_out_of_range_is_invalid(server, receiver):
    with pytest.raises(InvalidRequest, match=r"block indexes \[3\] outside \[0, 3\)"):
        list(receiver.pull(server.address, "t1", [0, 3]))


def test_a_bit_flipped_on_the_wire_is_rejected(held, receiver, no_thread_leak):
    server = GrpcKVServer(_CorruptingServicer(COMPAT, held, _block), "127.0.0.1", 0)
    try:
        with pytest.raises(ChecksumMismatch, match="block 1: checksum"):
            list(receiver.pull(server.address, "t1", [1]))
    finally:
        server.stop(grace_s=0)


def test_server_serves_health_checks(server):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(server.address) as channel:
        response = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""))
    assert response.status == health_pb2.HealthCheckResponse.SERVING


def test_chunks_of_a_block_never_exceed_one_mib():
    sizes = [len(c.data) for c in iter_block_chunks(0, _block(1), b"")]
    assert sizes == [1 << 20, 1 << 20, 1 << 20, 5]

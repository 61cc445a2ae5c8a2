"""Real gRPC KV server and receiver over loopback, with an in-memory block source."""

import grpc
import numpy as np
import pytest

from decode.kv.kv_port_client import KVPortClient
from pdmesh.errors import ChecksumMismatch, Incompatible, InvalidRequest, TransferNotFound
from pdmesh.transport.chunking import iter_block_chunks
from pdmesh.v1 import common_pb2
from prefill.kv.grpc_kv_server import GrpcKVServer, KVTransferServicer
from prefill.kv.held_transfers import HeldTransfer, HeldTransfers

BLOCK_NBYTES = 3 * 1024 * 1024 + 5  # spans four 1 MiB chunks
COMPAT = common_pb2.CompatInfo(model_fingerprint="fp", dtype="float32", block_size=32, layout="l",
                               num_layers=4, block_nbytes=BLOCK_NBYTES)


def _block(block_id: int, block_nbytes: int = BLOCK_NBYTES) -> memoryview:
    return memoryview(bytes([block_id % 256]) * block_nbytes)


def _rows(block_ids: list[int], block_nbytes: int = BLOCK_NBYTES) -> np.ndarray:
    return np.stack([np.frombuffer(_block(i, block_nbytes), dtype=np.uint8) for i in block_ids])


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
    server = GrpcKVServer(KVTransferServicer(COMPAT, held, _rows, wait_timeout_s=0.2), "127.0.0.1", 0)
    yield server
    server.stop(grace_s=0)


@pytest.fixture
def receiver():
    receiver = KVPortClient(COMPAT, timeout_s=10)
    yield receiver
    receiver.close()


def test_pull_streams_the_asked_blocks_in_order_and_release_frees_them(server, receiver, held):
    blocks = list(receiver.pull(server.address, "t1", [2, 0]))
    assert [b.block_index for b in blocks] == [2, 0]
    assert [b.block_hash for b in blocks] == [b"h9", b"h7"]
    assert bytes(blocks[0].payload) == bytes(_block(9)) and bytes(blocks[1].payload) == bytes(_block(7))
    assert receiver.release_soon(server.address, "t1").result().released
    assert held.take_finished() == {"t1"}


def test_mismatched_layout_fails_at_handshake_with_the_differing_fields(server):
    other = common_pb2.CompatInfo()
    other.CopyFrom(COMPAT)
    other.block_size = 64
    other.dtype = "bfloat16"
    receiver = KVPortClient(other)
    with pytest.raises(Incompatible, match=r"dtype: prefill='float32' decode='bfloat16'; block_size: prefill=32 decode=64"):
        list(receiver.pull(server.address, "t1", [0]))
    receiver.close()


def test_unknown_transfer_is_not_found(server, receiver):
    with pytest.raises(TransferNotFound, match="no KV held for transfer 'nope'"):
        list(receiver.pull(server.address, "nope", [0]))


def test_block_index_out_of_range_is_invalid(server, receiver):
    with pytest.raises(InvalidRequest, match=r"block indexes \[3\] outside \[0, 3\)"):
        list(receiver.pull(server.address, "t1", [0, 3]))


@pytest.mark.parametrize("method, streaming", [("Pull", True), ("Release", False), ("Handshake", False)])
def test_bytes_that_are_no_message_are_invalid_argument_and_the_server_keeps_serving(server, receiver, held,
                                                                                    method, streaming):
    """gRPC's synchronous server answers INTERNAL ("Exception deserializing request!") by itself."""
    with grpc.insecure_channel(server.address) as channel:
        call = (channel.unary_stream if streaming else channel.unary_unary)(f"/pdmesh.v1.KVTransfer/{method}")
        with pytest.raises(grpc.RpcError) as error:
            answer = call(b"\xff\xff\xff", timeout=10)
            list(answer) if streaming else answer
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.value.details().startswith(f"malformed request to /pdmesh.v1.KVTransfer/{method}: Error parsing")
    assert [b.block_index for b in receiver.pull(server.address, "t1", [1])] == [1]


def test_a_bit_flipped_on_the_wire_is_rejected(held, receiver, no_thread_leak):
    server = GrpcKVServer(_CorruptingServicer(COMPAT, held, _rows), "127.0.0.1", 0)
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


SMALL_NBYTES = 128 * 1024
SMALL_COMPAT = common_pb2.CompatInfo(model_fingerprint="fp", dtype="float32", block_size=32, layout="l",
                                     num_layers=4, block_nbytes=SMALL_NBYTES)


@pytest.mark.parametrize("corrupt", [False, True])
def test_small_blocks_travel_eight_to_a_message_and_each_is_verified(no_thread_leak, corrupt):
    held = HeldTransfers()
    block_ids = tuple(range(100, 120))
    held.hold(HeldTransfer("t2", block_ids=block_ids, block_hashes=tuple(b"h%d" % i for i in block_ids),
                           deadline=1e18))
    sent = []

    class Recording(KVTransferServicer):
        def Pull(self, request, context):
            for i, chunk in enumerate(super().Pull(request, context)):
                if corrupt and i == 1:
                    data = bytearray(chunk.data)
                    data[3 * SMALL_NBYTES + 5] ^= 0x01  # the run's fourth block
                    chunk.data = bytes(data)
                sent.append(list(chunk.run_block_indexes))
                yield chunk

    server = GrpcKVServer(Recording(SMALL_COMPAT, held, lambda ids: _rows(ids, SMALL_NBYTES)), "127.0.0.1", 0)
    receiver = KVPortClient(SMALL_COMPAT, timeout_s=10)
    try:
        asked = list(range(19, -1, -1))
        if corrupt:
            with pytest.raises(ChecksumMismatch, match="block 8: checksum"):
                list(receiver.pull(server.address, "t2", asked))
            return
        blocks = list(receiver.pull(server.address, "t2", asked))
        assert sent == [asked[:8], asked[8:16], asked[16:]]
        assert [b.block_index for b in blocks] == asked
        assert all(bytes(b.payload) == bytes(_block(100 + b.block_index, SMALL_NBYTES)) for b in blocks)
        assert blocks[0].block_hash == b"h119"
    finally:
        receiver.close()
        server.stop(grace_s=0)

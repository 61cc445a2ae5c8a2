"""The producer's KV port in the layer-wise flow, over real gRPC: Watch answers progress as the
engine reports layers, then the held transfer's checksums; a layer-range Pull streams what was
written of a transfer still being prefilled; ids it does not know are refused."""

from concurrent.futures import Future

import numpy as np
import pytest

from decode.kv.kv_port_client import KVPortClient
from pdmesh.errors import InvalidRequest, TransferNotFound
from pdmesh.transport.chunking import rows_of
from pdmesh.v1 import common_pb2
from prefill.kv.grpc_kv_server import GrpcKVServer, KVTransferServicer
from prefill.kv.held_transfers import HeldTransfer, HeldTransfers
from prefill.kv.layer_progress import LayerProgress

NUM_LAYERS, LAYER_NBYTES = 4, 256
COMPAT = common_pb2.CompatInfo(model_fingerprint="fp", dtype="float32", block_size=32, layout="l",
                               num_layers=NUM_LAYERS, block_nbytes=NUM_LAYERS * LAYER_NBYTES)


def _layer_rows(block_ids: list[int], layers: range) -> np.ndarray:
    """Block b's layer l holds bytes of value 16 * l + b."""
    return np.stack([np.concatenate([np.full(LAYER_NBYTES, 16 * layer + block_id, np.uint8) for layer in layers])
                     for block_id in block_ids])


@pytest.fixture
def producer(no_thread_leak):
    held = HeldTransfers()
    progress = LayerProgress(NUM_LAYERS, held)
    servicer = KVTransferServicer(COMPAT, held, lambda ids: _layer_rows(ids, range(NUM_LAYERS)),
                                  block_checksums=lambda ids: [100 + i for i in ids], progress=progress,
                                  read_layers=_layer_rows, wait_timeout_s=0.2)
    server = GrpcKVServer(servicer, "127.0.0.1", 0)
    receiver = KVPortClient(COMPAT, timeout_s=5)
    yield server.address, receiver, progress, held
    receiver.close()
    server.stop(grace_s=0)


def test_watch_follows_the_layers_then_answers_the_held_transfers_checksums(producer):
    address, receiver, progress, held = producer
    assert receiver.watch(address, "t" * 24, 0, 0.05).version == 0  # not scheduled yet
    progress.start_step("t" * 24, "r1", [7, 3], 0, 64)
    progress.layer_done(0)
    answer = receiver.watch(address, "t" * 24, 0, 1.0)
    assert (list(answer.block_ids), answer.num_partial_tokens, answer.num_partial_layers) == ([7, 3], 64, 1)
    progress.step_done()
    held.hold(HeldTransfer("t" * 24, (7, 3), (b"h7", b"h3"), deadline=1e18))
    progress.held("t" * 24)
    done = receiver.watch(address, "t" * 24, answer.version, 1.0, block_indexes=[1], transport="shm")
    assert (done.held, list(done.checksums), list(done.block_hashes)) == (True, [103], [b"h3"])


def test_a_layer_pull_streams_the_written_layers_of_a_transfer_being_prefilled(producer):
    address, receiver, progress, _ = producer
    progress.start_step("t" * 24, "r1", [7, 3], 0, 64)
    (blocks,) = list(receiver.pull_runs(address, "t" * 24, [0, 1], layers=range(1, 3)))
    assert rows_of(blocks).tolist() == _layer_rows([7, 3], range(1, 3)).tolist()


def test_unknown_or_ended_transfers_and_other_layers_are_refused(producer):
    address, receiver, progress, _ = producer
    with pytest.raises(TransferNotFound):
        list(receiver.pull_runs(address, "guessed-id-000000000000", [0], layers=range(0, 1)))
    progress.start_step("t" * 24, "r1", [7], 0, 20)
    with pytest.raises(InvalidRequest):
        list(receiver.pull_runs(address, "t" * 24, [0], layers=range(3, 5)))
    with pytest.raises(InvalidRequest):
        list(receiver.pull_runs(address, "t" * 24, [1], layers=range(0, 1)))  # not one of its blocks
    progress.end("t" * 24)
    with pytest.raises(TransferNotFound):
        receiver.watch(address, "t" * 24, 0, 1.0)


def test_watch_answers_a_written_prompts_checksums_before_it_is_held_and_a_release_waits_for_the_hold(producer):
    address, receiver, progress, held = producer
    progress.start_step("t" * 24, "r1", [7, 3], 0, 64)
    progress.step_done()
    written = HeldTransfer("t" * 24, (7, 3), (b"h7", b"h3"), deadline=float("inf"), checksums=_done([55, 66]))
    progress.written("t" * 24, written, restarts=0)
    done = receiver.watch(address, "t" * 24, 0, 1.0, block_indexes=[1], transport="shm")
    assert (done.held, list(done.block_ids), list(done.checksums), list(done.block_hashes)) == (
        True, [7, 3], [66], [b"h3"])
    with pytest.raises(InvalidRequest):
        receiver.watch(address, "t" * 24, 0, 1.0, block_indexes=[2], transport="shm")
    assert held.release("t" * 24) is False   # the consumer is done before the engine held it
    held.hold(HeldTransfer("t" * 24, (7, 3), (b"h7", b"h3"), deadline=1e18))
    progress.held("t" * 24)
    assert (held.num_held, held.take_finished()) == (0, {"t" * 24})  # freed at the hold


def _done(value) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future

"""The connector's worker side without vLLM: two ConnectorWorkers (producer and consumer) over a
real gRPC KV server, and a consumer whose pull breaks part-way (fault injected in the receiver)."""

from __future__ import annotations

import pytest
import torch

from pdmesh.config import TelemetrySettings
from pdmesh.connector.metadata import PDMeshConnectorMetadata, RecvTask, SendTask
from pdmesh.connector.worker_side import ConnectorWorker
from pdmesh.errors import ChecksumMismatch
from pdmesh.transport.chunking import AssembledBlock

BLOCK_SIZE, NUM_BLOCKS = 32, 8
TOKENS = list(range(3, 3 + 80))  # 3 blocks, the last one partial


def _worker(model_dir, is_producer: bool) -> ConnectorWorker:
    worker = ConnectorWorker(model=str(model_dir), block_size=BLOCK_SIZE, is_producer=is_producer,
                             kv_host="127.0.0.1", kv_port=0, hold_timeout_s=60, pull_timeout_s=10,
                             telemetry=TelemetrySettings())
    caches = {f"l{i}": (torch.randn if is_producer else torch.zeros)(NUM_BLOCKS, 2, BLOCK_SIZE, 16)
              for i in range(2)}
    worker.register_kv_caches(caches, NUM_BLOCKS)
    worker.caches = caches
    return worker


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    return tmp_path


def _recv_task(producer: ConnectorWorker, local_block_ids: list[int]) -> RecvTask:
    return RecvTask(request_id="d-1", pdmesh_request_id="mesh-1", transfer_id="p-1",
                    kv_address=producer._server.address, block_indexes=[0, 1, 2],
                    local_block_ids=local_block_ids, token_ids=TOKENS)


def _finish(worker: ConnectorWorker, meta: PDMeshConnectorMetadata) -> None:
    worker.start_tasks(meta)
    worker._pool.shutdown(wait=True)  # let the pull finish before asserting


def test_blocks_move_between_workers_and_the_producer_frees_them(model_dir, no_thread_leak):
    producer, consumer = _worker(model_dir, True), _worker(model_dir, False)
    try:
        producer.start_tasks(PDMeshConnectorMetadata(sends=[SendTask("p-1", [5, 2, 7], TOKENS)]))
        _finish(consumer, PDMeshConnectorMetadata(recvs=[_recv_task(producer, [1, 4, 6])]))
        for name in producer.caches:
            for remote, local in zip([5, 2, 7], [1, 4, 6]):
                assert torch.equal(consumer.caches[name][local], producer.caches[name][remote])
        assert consumer.get_finished() == (None, {"d-1"})
        assert consumer.take_failed_block_ids() == set()
        stats = consumer.take_worker_meta().stats["d-1"]  # goes to the scheduler with this step's output
        assert consumer.take_worker_meta() is None
        assert (stats["num_blocks"], stats["num_bytes"], stats["num_reused_tokens"]) == (3, 3 * 2 * 2 * 32 * 16 * 4, 80)
        assert producer.get_finished() == ({"p-1"}, None)
        assert producer.counters()["kv_bytes_sent"] == stats["num_bytes"]
    finally:
        producer.shutdown()
        consumer.shutdown()


def test_tokens_that_differ_from_the_producers_are_refused(model_dir, no_thread_leak):
    producer, consumer = _worker(model_dir, True), _worker(model_dir, False)
    try:
        producer.start_tasks(PDMeshConnectorMetadata(sends=[SendTask("p-1", [5, 2, 7], TOKENS)]))
        task = _recv_task(producer, [1, 4, 6])
        task.token_ids = TOKENS[:40] + [999] + TOKENS[41:]  # differs inside block 1
        _finish(consumer, PDMeshConnectorMetadata(recvs=[task]))
        assert consumer.take_failed_block_ids() == {4, 6}  # block 0 is good and kept
        assert torch.equal(consumer.caches["l0"][1], producer.caches["l0"][5])
        assert consumer.get_finished() == (None, {"d-1"})  # still reported: vLLM recomputes the rest
        assert producer.get_finished() == ({"p-1"}, None)  # and released
    finally:
        producer.shutdown()
        consumer.shutdown()


class _BreaksAfterOneBlock:
    def __init__(self, real) -> None:
        self._real = real
        self.released: list[str] = []

    def pull_runs(self, address, transfer_id, block_indexes):
        first = next(self._real.pull(address, transfer_id, block_indexes))
        yield [AssembledBlock(first.block_index, bytearray(first.payload), first.block_hash)]  # a message of one
        raise ChecksumMismatch("block 1: checksum 0x1 != sent 0x2")

    def release(self, address, transfer_id):
        self.released.append(transfer_id)
        self._real.release(address, transfer_id)

    def close(self):
        self._real.close()


def test_a_pull_that_breaks_part_way_keeps_the_prefix_and_reports_the_rest(model_dir, no_thread_leak):
    producer, consumer = _worker(model_dir, True), _worker(model_dir, False)
    consumer._receiver = _BreaksAfterOneBlock(consumer._receiver)
    try:
        producer.start_tasks(PDMeshConnectorMetadata(sends=[SendTask("p-1", [5, 2, 7], TOKENS)]))
        _finish(consumer, PDMeshConnectorMetadata(recvs=[_recv_task(producer, [1, 4, 6])]))
        assert consumer.take_failed_block_ids() == {4, 6}
        assert consumer.get_finished() == (None, {"d-1"})
        stats = consumer.take_worker_meta().stats["d-1"]
        assert (stats["num_blocks"], stats["num_failed_blocks"], stats["num_reused_tokens"]) == (1, 2, 32)
        assert consumer._receiver.released == ["p-1"]
    finally:
        producer.shutdown()
        consumer.shutdown()

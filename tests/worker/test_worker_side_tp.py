"""The connector's worker side across tensor-parallel ranks, without vLLM: each producer rank serves
its own KV port; a consumer reads its peer rank, or the head shares of k producer ranks into place."""

from __future__ import annotations

import pytest
import torch

from pdmesh.config import KVTransportSettings, TelemetrySettings
from pdmesh.kv.tasks import RecvTask, SendTask
from tests.kv_task_names import named
from tests.worker.kv_workers import BLOCK_SIZE, NUM_BLOCKS, TOKENS, TRANSPORTS, finish, same_block
from worker.metadata import PDMeshConnectorMetadata
from worker.worker_side import ConnectorWorker


def _ranks(model_dir, tp_size: int, shape, transport: str = "auto", num_kv_heads: int = 0) -> list[ConnectorWorker]:
    """A producer's tensor-parallel ranks on kv ports P, P + 1, ...; rank r's KV is r + 1 + noise."""
    from worker.engine import free_port

    base, workers = free_port("127.0.0.1", tp_size), []   # P .. P + tp_size - 1 free
    for rank in range(tp_size):
        worker = ConnectorWorker(model=str(model_dir), block_size=BLOCK_SIZE, is_producer=True, kv_host="127.0.0.1",
                                 kv_port=base, hold_timeout_s=60, pull_timeout_s=10, telemetry=TelemetrySettings(),
                                 transport=KVTransportSettings(kv_transport=transport, mooncake_host="127.0.0.1"), tp_rank=rank,
                                 tp_size=tp_size, num_kv_heads=num_kv_heads)
        worker.caches = {f"l{i}": torch.rand(*shape) + rank + 1 for i in range(2)}
        worker.register_kv_caches(worker.caches, NUM_BLOCKS)
        workers.append(worker)
    return workers


def _consumer(model_dir, shape, transport: str = "auto", tp_rank: int = 0, tp_size: int = 1,
              num_kv_heads: int = 0) -> ConnectorWorker:
    consumer = ConnectorWorker(model=str(model_dir), block_size=BLOCK_SIZE, is_producer=False, kv_host="127.0.0.1",
                               kv_port=0, hold_timeout_s=60, pull_timeout_s=10, telemetry=TelemetrySettings(),
                               transport=KVTransportSettings(kv_transport=transport, mooncake_host="127.0.0.1"), tp_rank=tp_rank, tp_size=tp_size,
                               num_kv_heads=num_kv_heads)
    consumer.caches = {f"l{i}": torch.zeros(*shape) for i in range(2)}
    consumer.register_kv_caches(consumer.caches, NUM_BLOCKS)
    return consumer


def _tp_recv(producer: ConnectorWorker, tp_size: int, local_block_ids: list[int]) -> RecvTask:
    return named(producer, RecvTask(request_id="d-1", pdmesh_request_id="m", transfer_id="p-1",
                                    kv_address=producer.producer.server.address, block_indexes=[0, 1, 2],
                                    local_block_ids=local_block_ids, token_ids=TOKENS, producer_tp_size=tp_size))



def test_each_tensor_parallel_rank_serves_on_its_own_port_and_reads_its_peer_rank(model_dir, no_thread_leak):
    """Rank 1 of a producer whose KV port is P serves on P + 1; rank 1 of a consumer given the
    handle's address (rank 0's port) reads from P + 1."""
    shape = (NUM_BLOCKS, 2, BLOCK_SIZE, 16)
    workers = _ranks(model_dir, 2, shape)
    consumer = _consumer(model_dir, shape, tp_rank=1, tp_size=2)
    try:
        base = int(workers[0].producer.server.address.rsplit(":", 1)[1])
        assert workers[1].producer.server.address == f"127.0.0.1:{base + 1}"
        for worker in workers:
            worker.start_tasks(PDMeshConnectorMetadata(sends=[named(worker, SendTask("p-1", [5, 2, 7], TOKENS))]))
        finish(consumer, PDMeshConnectorMetadata(recvs=[_tp_recv(workers[0], 2, [1, 4, 6])]))
        assert consumer.take_failed_block_ids() == set()
        assert same_block(consumer, workers[1], 4, 2)  # rank 1's KV
        assert workers[1].get_finished() == ({"p-1"}, None) and workers[0].counters()["num_held_transfers"] == 1
    finally:
        for worker in [consumer, *workers]:
            worker.shutdown()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_consumer_with_one_rank_reads_each_of_two_producer_ranks_heads_into_place(model_dir, transport,
                                                                                     no_thread_leak):
    """Prefill TP = 2 (1 KV head a rank), decode TP = 1 (2 heads), the CPU backend's head-major
    blocks [num_blocks, heads, block_size, 2 * head_size]: rank j's head lands as head j."""
    workers = _ranks(model_dir, 2, (NUM_BLOCKS, 1, BLOCK_SIZE, 32), transport, num_kv_heads=1)
    consumer = _consumer(model_dir, (NUM_BLOCKS, 2, BLOCK_SIZE, 32), transport, num_kv_heads=2)
    try:
        for worker in workers:
            worker.start_tasks(PDMeshConnectorMetadata(sends=[named(worker, SendTask("p-1", [5, 2, 7], TOKENS))]))
        finish(consumer, PDMeshConnectorMetadata(recvs=[_tp_recv(workers[0], 2, [1, 4, 6])]))
        assert consumer.take_failed_block_ids() == set()
        for name in consumer.caches:
            for remote, local in zip([5, 2, 7], [1, 4, 6]):
                assert torch.equal(consumer.caches[name][local], torch.cat([w.caches[name][remote] for w in workers]))
        assert consumer.get_finished() == (None, {"d-1"})
        stats = consumer.take_worker_meta().stats["d-1"]
        assert (stats["num_blocks"], stats["num_bytes"], stats["transport"]) == (3, 3 * 2 * 2 * BLOCK_SIZE * 32 * 4,
                                                                                 transport)
        assert [w.get_finished() for w in workers] == [({"p-1"}, None)] * 2  # released on both ranks
    finally:
        for worker in [consumer, *workers]:
            worker.shutdown()


def test_a_consumer_whose_blocks_are_not_head_major_recomputes_instead_of_reading_shares(model_dir,
                                                                                         no_thread_leak):
    workers = _ranks(model_dir, 2, (NUM_BLOCKS, 1, BLOCK_SIZE, 32), num_kv_heads=1)
    consumer = _consumer(model_dir, (NUM_BLOCKS, BLOCK_SIZE, 2, 32), num_kv_heads=2)  # token-major
    try:
        for worker in workers:
            worker.start_tasks(PDMeshConnectorMetadata(sends=[named(worker, SendTask("p-1", [5, 2, 7], TOKENS))]))
        finish(consumer, PDMeshConnectorMetadata(recvs=[_tp_recv(workers[0], 2, [1, 4, 6])]))
        assert consumer.take_failed_block_ids() == {1, 4, 6}
        assert not any(cache.any() for cache in consumer.caches.values())
        assert [w.get_finished() for w in workers] == [({"p-1"}, None)] * 2
    finally:
        for worker in [consumer, *workers]:
            worker.shutdown()

def test_a_handle_whose_ranks_do_not_divide_is_recomputed_not_left_waiting(model_dir, no_thread_leak):
    """A producer with 3 ranks for a consumer with 2: nothing can be read, the request is reported
    received with every block failed (vLLM recomputes them), and nothing escapes the reader thread."""
    shape = (NUM_BLOCKS, 2, BLOCK_SIZE, 16)
    consumer = _consumer(model_dir, shape, tp_rank=1, tp_size=2)
    try:
        task = RecvTask(request_id="d-1", pdmesh_request_id="m", transfer_id="p-1", kv_address="127.0.0.1:1",
                        block_indexes=[0, 1], local_block_ids=[3, 4], token_ids=TOKENS[:64], producer_tp_size=3)
        consumer.consumer._receive(task)
        assert consumer.get_finished() == (None, {"d-1"})
        assert consumer.take_failed_block_ids() == {3, 4}
    finally:
        consumer.shutdown()

"""The connector's worker side without vLLM: two ConnectorWorkers (producer and consumer) over each
real transport (shared memory, Mooncake Transfer Engine over TCP, gRPC), the transport agreed at a
real handshake on the producer's KV port; tampered KV with and without the checksum; a read that
breaks part-way."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from pdmesh.config import KVFaultSettings, KVTransportSettings, TelemetrySettings
from pdmesh.errors import ChecksumMismatch, TransferNotFound
from pdmesh.kv.tasks import LayerwiseStep, RecvTask, SendTask
from pdmesh.transport.affinity import widen_affinity
from tests.pdmesh.blackhole import blackholed_address
from worker.metadata import PDMeshConnectorMetadata
from worker.worker_side import ConnectorWorker

BLOCK_SIZE, NUM_BLOCKS = 32, 8
TOKENS = list(range(3, 3 + 80))  # 3 blocks, the last one partial
TRANSPORTS = ["shm", "mooncake", "grpc"]
FAULTS = KVFaultSettings(tamper_request_prefix="tamper-", unverified_request_prefix="tamper-unverified-")


def _worker(model_dir, is_producer: bool, transport: str, shape=(NUM_BLOCKS, 2, BLOCK_SIZE, 16),
            pull_timeout_s: float = 10) -> ConnectorWorker:
    worker = ConnectorWorker(model=str(model_dir), block_size=BLOCK_SIZE, is_producer=is_producer,
                             kv_host="127.0.0.1", kv_port=0, hold_timeout_s=60, pull_timeout_s=pull_timeout_s,
                             telemetry=TelemetrySettings(),
                             transport=KVTransportSettings(kv_transport=transport, mooncake_host="127.0.0.1", kv_faults=FAULTS))
    caches = {f"l{i}": (torch.randn if is_producer else torch.zeros)(*shape) for i in range(2)}
    worker.register_kv_caches(caches, NUM_BLOCKS)
    worker.caches = caches
    return worker


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    return tmp_path


@pytest.fixture(params=TRANSPORTS)
def pair(request, model_dir, no_thread_leak):
    producer, consumer = _worker(model_dir, True, request.param), _worker(model_dir, False, request.param)
    yield producer, consumer, request.param
    consumer.shutdown()
    producer.shutdown()


def _recv_task(producer: ConnectorWorker, local_block_ids: list[int], mesh_id: str = "mesh-1",
               transfer_id: str = "p-1") -> RecvTask:
    return RecvTask(request_id="d-1", pdmesh_request_id=mesh_id, transfer_id=transfer_id,
                    kv_address=producer.producer.server.address, block_indexes=[0, 1, 2],
                    local_block_ids=local_block_ids, token_ids=TOKENS)


def _finish(worker: ConnectorWorker, meta: PDMeshConnectorMetadata) -> None:
    worker.start_tasks(meta)
    worker.consumer.pool.shutdown(wait=True)  # let the pull finish before asserting


def _same(consumer, producer, local: int, remote: int) -> bool:
    return all(torch.equal(consumer.caches[name][local], producer.caches[name][remote]) for name in producer.caches)


def test_blocks_move_between_workers_and_the_producer_frees_them(pair):
    producer, consumer, transport = pair
    producer.start_tasks(PDMeshConnectorMetadata(sends=[SendTask("p-1", [5, 2, 7], TOKENS, engine_request_id="e-1")]))
    _finish(consumer, PDMeshConnectorMetadata(recvs=[_recv_task(producer, [1, 4, 6])]))
    assert all(_same(consumer, producer, local, remote) for remote, local in zip([5, 2, 7], [1, 4, 6]))
    assert consumer.get_finished() == (None, {"d-1"})
    assert consumer.take_failed_block_ids() == set()
    stats = consumer.take_worker_meta().stats["d-1"]  # goes to the scheduler with this step's output
    assert consumer.take_worker_meta() is None
    assert (stats["num_blocks"], stats["num_bytes"], stats["num_reused_tokens"]) == (3, 3 * 2 * 2 * 32 * 16 * 4, 80)
    assert stats["transport"] == transport
    assert producer.get_finished() == ({"e-1"}, None)  # vLLM frees the blocks by its own request id
    assert producer.counters()["kv_bytes_sent_by_transport"] == {transport: stats["num_bytes"]}


def test_runs_of_contiguous_blocks_and_kv_split_layouts_move_too(model_dir, no_thread_leak):
    """(2, num_blocks, ...) layers (K and V apart) over shared memory, a run of 4 and a lone block."""
    shape = (2, NUM_BLOCKS, BLOCK_SIZE, 8)
    producer, consumer = _worker(model_dir, True, "shm", shape), _worker(model_dir, False, "shm", shape)
    tokens = list(range(3, 3 + 5 * BLOCK_SIZE))
    try:
        producer.start_tasks(PDMeshConnectorMetadata(sends=[SendTask("p-1", [1, 2, 3, 4, 0], tokens)]))
        task = RecvTask(request_id="d-1", pdmesh_request_id="m", transfer_id="p-1",
                        kv_address=producer.producer.server.address, block_indexes=[0, 1, 2, 3, 4],
                        local_block_ids=[3, 4, 5, 6, 1], token_ids=tokens)
        _finish(consumer, PDMeshConnectorMetadata(recvs=[task]))
        assert consumer.take_failed_block_ids() == set()
        for name in producer.caches:
            assert torch.equal(consumer.caches[name][:, 3:7], producer.caches[name][:, 1:5])
            assert torch.equal(consumer.caches[name][:, 1], producer.caches[name][:, 0])
            assert not consumer.caches[name][:, 0].any() and not consumer.caches[name][:, 7].any()
    finally:
        consumer.shutdown()
        producer.shutdown()


def test_a_layerwise_read_finishes_once_the_prompt_is_written_before_the_producer_holds_it(pair):
    """The consumer reads each layer as it is written and verifies against the checksums published
    when the last step is done; its release comes before the engine holds the transfer (a step
    later), and the hold then frees the blocks at once."""
    producer, consumer, _ = pair
    step = LayerwiseStep("lw-1", "mesh-1", [5, 2, 7], 0, len(TOKENS), prompt_token_ids=TOKENS)
    consumer.start_tasks(PDMeshConnectorMetadata(recvs=[RecvTask(
        request_id="d-1", pdmesh_request_id="mesh-1", transfer_id="lw-1", kv_address=producer.producer.server.address,
        block_indexes=[0, 1, 2], local_block_ids=[1, 2, 3], token_ids=TOKENS, layerwise=True)]))
    producer.start_tasks(PDMeshConnectorMetadata(layerwise_steps=[step]))
    for name in producer.caches:
        producer.layer_saved(name)
    producer.step_saved()
    deadline = time.monotonic() + 10
    while (received := consumer.get_finished()[1]) is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert received == {"d-1"} and consumer.take_failed_block_ids() == set()
    assert all(_same(consumer, producer, local, remote) for local, remote in [(1, 5), (2, 2), (3, 7)])
    consumer.consumer._layerwise_pool.shutdown(wait=True)  # its release is sent
    wait_until = time.monotonic() + 5
    while not producer.producer.held._released_early and time.monotonic() < wait_until:
        time.sleep(0.01)
    producer.start_tasks(PDMeshConnectorMetadata(sends=[SendTask("lw-1", [5, 2, 7], TOKENS,
                                                                 engine_request_id="p-1")]))
    assert (producer.producer.held.num_held, producer.get_finished()[0]) == (0, {"p-1"})


def _widened() -> set[int]:
    """The cores a widened thread gets here (every core this process may use)."""
    cores: list[set[int]] = []
    thread = threading.Thread(target=lambda: (widen_affinity(), cores.append(os.sched_getaffinity(0))))
    thread.start()
    thread.join()
    return cores[0]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to tell them apart")
def test_layerwise_reads_run_on_the_workers_cores_and_pulls_on_any(model_dir, no_thread_leak, monkeypatch):
    """A layer-wise read runs while its producer computes: widened to every core, it took the
    producer's on a shared host (bench/REPORT.md). A pull, after the producer is done, may run anywhere."""
    worker_core = max(os.sched_getaffinity(0))
    consumer = ConnectorWorker(model=str(model_dir), block_size=BLOCK_SIZE, is_producer=False, kv_host="127.0.0.1",
                               kv_port=0, hold_timeout_s=60, pull_timeout_s=10, telemetry=TelemetrySettings(),
                               transport=KVTransportSettings(kv_transport="shm"), thread_cpus=str(worker_core))
    consumer.register_kv_caches({"l0": torch.zeros(NUM_BLOCKS, 2, BLOCK_SIZE, 16)}, NUM_BLOCKS)
    cores_of: dict[str, set[int]] = {}
    monkeypatch.setattr(consumer, "_receive", lambda task: cores_of.setdefault(task.request_id,
                                                                               os.sched_getaffinity(0)))
    consumer.start_tasks(PDMeshConnectorMetadata(recvs=[
        RecvTask(request_id=request_id, pdmesh_request_id="mesh-1", transfer_id="t-" + request_id,
                 kv_address="127.0.0.1:1", block_indexes=[0], local_block_ids=[1], token_ids=TOKENS,
                 layerwise=layerwise) for request_id, layerwise in (("lw", True), ("pull", False))]))
    consumer.shutdown()
    assert cores_of == {"lw": {worker_core}, "pull": _widened()}


def test_a_layerwise_transfer_freed_before_vllms_batch_update_publishes_nothing(model_dir, no_thread_leak):
    """vLLM's handle_preemptions (before its batch update, which may zero newly allocated blocks)
    ends the transfers whose blocks were freed: a checksum job that finishes after it is dropped."""
    producer = _worker(model_dir, True, "grpc")
    try:
        step = LayerwiseStep("lw-2", "mesh-2", [5, 2, 7], 0, len(TOKENS), prompt_token_ids=TOKENS)
        producer.start_tasks(PDMeshConnectorMetadata(layerwise_steps=[step]))
        restarts = producer.producer.progress.restarts("lw-2")
        producer.end_freed_transfers(PDMeshConnectorMetadata(layerwise_ended=["lw-2"]))
        producer.producer._publish_written(step, restarts)  # the job, finishing late
        assert producer.producer.progress.written_transfer("lw-2") is None
        with pytest.raises(TransferNotFound):
            producer.producer.progress.watch("lw-2", 0, wait_s=0)
    finally:
        producer.shutdown()


def test_tokens_that_differ_from_the_producers_are_refused(pair):
    producer, consumer, _ = pair
    producer.start_tasks(PDMeshConnectorMetadata(sends=[SendTask("p-1", [5, 2, 7], TOKENS)]))
    task = _recv_task(producer, [1, 4, 6])
    task.token_ids = TOKENS[:40] + [999] + TOKENS[41:]  # differs inside block 1
    _finish(consumer, PDMeshConnectorMetadata(recvs=[task]))
    assert consumer.take_failed_block_ids() == {4, 6}  # block 0 is good and kept
    assert _same(consumer, producer, 1, 5)
    assert consumer.get_finished() == (None, {"d-1"})  # still reported: vLLM recomputes the rest
    assert producer.get_finished() == ({"p-1"}, None)  # and released


def test_a_release_the_producer_does_not_answer_holds_the_transfer_thread_a_moment_only(pair, monkeypatch):
    """The consumer reports the request received, then releases the producer's blocks; a Release
    left unanswered (in a soak one was, for its whole 30 s timeout, on both transfer threads of a
    worker) keeps the thread about a second, not until its timeout."""
    producer, consumer, _ = pair
    answer = threading.Event()
    release = producer.producer.held.release
    monkeypatch.setattr(producer.producer.held, "release", lambda transfer_id: answer.wait(30) and release(transfer_id))
    producer.start_tasks(PDMeshConnectorMetadata(sends=[SendTask("p-1", [5, 2, 7], TOKENS, engine_request_id="e-1")]))
    started = time.monotonic()
    try:
        _finish(consumer, PDMeshConnectorMetadata(recvs=[_recv_task(producer, [1, 4, 6])]))
        assert time.monotonic() - started < 10   # the Release's timeout is 30 s
        assert consumer.get_finished() == (None, {"d-1"})
        assert producer.counters()["num_held_transfers"] == 1   # its release is still on its way
    finally:
        answer.set()
    deadline = time.monotonic() + 5
    while producer.counters()["num_held_transfers"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert producer.get_finished() == ({"e-1"}, None)


def test_kv_altered_between_producer_and_consumer_is_caught_by_the_checksum(pair):
    producer, consumer, _ = pair
    producer.start_tasks(PDMeshConnectorMetadata(sends=[SendTask("p-1", [5, 2, 7], TOKENS)]))
    _finish(consumer, PDMeshConnectorMetadata(recvs=[_recv_task(producer, [1, 4, 6], mesh_id="tamper-1")]))
    assert consumer.take_failed_block_ids() == {1, 4, 6}  # the first block was altered: nothing is kept
    stats = consumer.take_worker_meta().stats if consumer.get_finished()[1] else {}
    assert stats["d-1"]["num_blocks"] == 0


def test_without_the_checksum_altered_kv_lands_unnoticed(pair):
    """The control: the same alteration with the check off goes through, and the cache holds other
    bytes than the producer's (what the e2e control turns into different tokens)."""
    producer, consumer, _ = pair
    producer.start_tasks(PDMeshConnectorMetadata(sends=[SendTask("p-1", [5, 2, 7], TOKENS)]))
    _finish(consumer, PDMeshConnectorMetadata(recvs=[_recv_task(producer, [1, 4, 6],
                                                                 mesh_id="tamper-unverified-1")]))
    assert consumer.take_failed_block_ids() == set()
    assert not _same(consumer, producer, 1, 5)


class _BreaksAfterOneBlock:
    """A reader whose read stops after its first block (the peer died part-way)."""

    def __init__(self, real) -> None:
        self._real = real
        self.transport = real.transport

    def read_blocks(self, link, transfer_id, block_indexes, local_block_ids, expected_hashes, options):
        yield from self._real.read_blocks(link, transfer_id, block_indexes[:1], local_block_ids[:1], expected_hashes,
                                          options)
        raise ChecksumMismatch("block 1: checksum 0x1 != sent 0x2")

    def close(self):
        self._real.close()


def test_a_read_that_breaks_part_way_keeps_the_prefix_and_reports_the_rest(pair):
    producer, consumer, transport = pair
    links = consumer.consumer.links_for((0, 1))
    links._readers[transport] = _BreaksAfterOneBlock(links._readers[transport])
    producer.start_tasks(PDMeshConnectorMetadata(sends=[SendTask("p-1", [5, 2, 7], TOKENS)]))
    _finish(consumer, PDMeshConnectorMetadata(recvs=[_recv_task(producer, [1, 4, 6])]))
    assert consumer.take_failed_block_ids() == {4, 6}
    assert consumer.get_finished() == (None, {"d-1"})
    stats = consumer.take_worker_meta().stats["d-1"]
    assert (stats["num_blocks"], stats["num_failed_blocks"], stats["num_reused_tokens"]) == (1, 2, 32)
    assert _same(consumer, producer, 1, 5)
    assert producer.get_finished() == ({"p-1"}, None)  # released all the same


def test_a_guessed_transfer_id_reads_nothing(pair):
    producer, consumer, _ = pair
    producer.producer.servicer._wait_timeout_s = 0.2
    producer.start_tasks(PDMeshConnectorMetadata(sends=[SendTask("p-1", [5, 2, 7], TOKENS)]))
    _finish(consumer, PDMeshConnectorMetadata(recvs=[_recv_task(producer, [1, 4, 6], transfer_id="p-2")]))
    assert consumer.take_failed_block_ids() == {1, 4, 6}
    assert not consumer.caches["l0"][1].any()
    assert producer.counters()["num_held_transfers"] == 1  # the guessed release freed nothing


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
    return RecvTask(request_id="d-1", pdmesh_request_id="m", transfer_id="p-1", kv_address=producer.producer.server.address,
                    block_indexes=[0, 1, 2], local_block_ids=local_block_ids, token_ids=TOKENS,
                    producer_tp_size=tp_size)


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
            worker.start_tasks(PDMeshConnectorMetadata(sends=[SendTask("p-1", [5, 2, 7], TOKENS)]))
        _finish(consumer, PDMeshConnectorMetadata(recvs=[_tp_recv(workers[0], 2, [1, 4, 6])]))
        assert consumer.take_failed_block_ids() == set()
        assert _same(consumer, workers[1], 4, 2)  # rank 1's KV
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
            worker.start_tasks(PDMeshConnectorMetadata(sends=[SendTask("p-1", [5, 2, 7], TOKENS)]))
        _finish(consumer, PDMeshConnectorMetadata(recvs=[_tp_recv(workers[0], 2, [1, 4, 6])]))
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
            worker.start_tasks(PDMeshConnectorMetadata(sends=[SendTask("p-1", [5, 2, 7], TOKENS)]))
        _finish(consumer, PDMeshConnectorMetadata(recvs=[_tp_recv(workers[0], 2, [1, 4, 6])]))
        assert consumer.take_failed_block_ids() == {1, 4, 6}
        assert not any(cache.any() for cache in consumer.caches.values())
        assert [w.get_finished() for w in workers] == [({"p-1"}, None)] * 2
    finally:
        for worker in [consumer, *workers]:
            worker.shutdown()


def test_the_cache_salt_is_part_of_the_blocks_hashes(pair):
    """Another tenant's salt names other blocks: a consumer salted differently refuses them all."""
    producer, consumer, _ = pair
    producer.start_tasks(PDMeshConnectorMetadata(sends=[SendTask("p-1", [5, 2, 7], TOKENS, extra_key=b"tenant-a")]))
    task = _recv_task(producer, [1, 4, 6])
    task.extra_key = b"tenant-b"
    _finish(consumer, PDMeshConnectorMetadata(recvs=[task]))
    assert consumer.take_failed_block_ids() == {1, 4, 6}


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


def test_a_read_of_a_minted_transfer_that_arrives_before_its_hold_waits_for_it(pair):
    """The scheduler mints a pull-flow id when the request is first scheduled and tells the workers with
    that step; the hold comes a step after the request finished. A read in between waits for the hold
    (a read of an id never minted is refused at once: test_a_guessed_transfer_id_reads_nothing)."""
    producer, consumer, _ = pair
    producer.start_tasks(PDMeshConnectorMetadata(minted_transfer_ids=["p-1"]))
    consumer.start_tasks(PDMeshConnectorMetadata(recvs=[_recv_task(producer, [1, 4, 6])]))
    time.sleep(0.2)  # the consumer's read is at the producer, waiting
    producer.start_tasks(PDMeshConnectorMetadata(sends=[SendTask("p-1", [5, 2, 7], TOKENS)]))
    consumer.consumer.pool.shutdown(wait=True)
    assert consumer.take_failed_block_ids() == set()
    assert all(_same(consumer, producer, local, remote) for remote, local in zip([5, 2, 7], [1, 4, 6]))


def test_a_minted_transfer_whose_request_ended_unheld_fails_its_read_at_once(pair):
    producer, consumer, _ = pair
    producer.start_tasks(PDMeshConnectorMetadata(minted_transfer_ids=["p-1"]))
    producer.start_tasks(PDMeshConnectorMetadata(unheld_transfer_ids=["p-1"]))
    started = time.monotonic()
    _finish(consumer, PDMeshConnectorMetadata(recvs=[_recv_task(producer, [1, 4, 6])]))
    assert time.monotonic() - started < 5 and consumer.take_failed_block_ids() == {1, 4, 6}


def test_pulls_from_a_producer_that_never_answers_leave_threads_for_the_others(model_dir, no_thread_leak):
    """Before: two threads served every pull of a consumer and every handshake went through one lock:
    two reads of a producer that takes connections and never answers stopped all reads for their timeout."""
    producer, consumer = _worker(model_dir, True, "grpc"), _worker(model_dir, False, "grpc", pull_timeout_s=2)
    try:
        producer.start_tasks(PDMeshConnectorMetadata(sends=[SendTask("p-1", [5, 2, 7], TOKENS)]))
        with blackholed_address() as dead:
            stuck = [RecvTask(request_id=f"d-dead-{n}", pdmesh_request_id="m", transfer_id=f"t-dead-{n}",
                              kv_address=dead, block_indexes=[0], local_block_ids=[n], token_ids=TOKENS[:BLOCK_SIZE])
                     for n in (0, 2)]
            started = time.monotonic()
            consumer.start_tasks(PDMeshConnectorMetadata(recvs=[*stuck, _recv_task(producer, [1, 4, 6])]))
            received: set[str] = set()
            while "d-1" not in received and time.monotonic() - started < 10:
                received |= consumer.get_finished()[1] or set()
                time.sleep(0.01)
            took = time.monotonic() - started
            consumer.consumer.pool.shutdown(wait=True)  # the dead producer's reads time out
        assert received == {"d-1"} and took < 1.0, f"{sorted(received)} after {took:.2f} s"
        assert consumer.take_failed_block_ids() == {0, 2}
        assert all(_same(consumer, producer, local, remote) for remote, local in zip([5, 2, 7], [1, 4, 6]))
    finally:
        consumer.shutdown()
        producer.shutdown()

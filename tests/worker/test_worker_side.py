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

from pdmesh.config import KVTransportSettings, TelemetrySettings
from pdmesh.errors import ChecksumMismatch, TransferNotFound
from pdmesh.kv.tasks import LayerwiseStep, RecvTask, SendTask
from pdmesh.transport.affinity import widen_affinity
from tests.kv_task_names import named, names
from tests.pdmesh.blackhole import blackholed_address
from tests.worker.kv_workers import BLOCK_SIZE, NUM_BLOCKS, TOKENS, finish, make_worker, recv_task, same_block
from worker.metadata import PDMeshConnectorMetadata
from worker.worker_side import ConnectorWorker


def test_blocks_move_between_workers_and_the_producer_frees_them(pair):
    producer, consumer, transport = pair
    producer.start_tasks(PDMeshConnectorMetadata(sends=[named(producer, SendTask("p-1", [5, 2, 7], TOKENS, engine_request_id="e-1"))]))
    finish(consumer, PDMeshConnectorMetadata(recvs=[recv_task(producer, [1, 4, 6])]))
    assert all(same_block(consumer, producer, local, remote) for remote, local in zip([5, 2, 7], [1, 4, 6]))
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
    producer, consumer = make_worker(model_dir, True, "shm", shape), make_worker(model_dir, False, "shm", shape)
    tokens = list(range(3, 3 + 5 * BLOCK_SIZE))
    try:
        producer.start_tasks(PDMeshConnectorMetadata(sends=[named(producer, SendTask("p-1", [1, 2, 3, 4, 0], tokens))]))
        task = named(consumer, RecvTask(request_id="d-1", pdmesh_request_id="m", transfer_id="p-1",
                                        kv_address=producer.producer.server.address, block_indexes=[0, 1, 2, 3, 4],
                                        local_block_ids=[3, 4, 5, 6, 1], token_ids=tokens))
        finish(consumer, PDMeshConnectorMetadata(recvs=[task]))
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
    step = LayerwiseStep("lw-1", "mesh-1", [5, 2, 7], 0, len(TOKENS), block_hashes=names(producer, TOKENS))
    consumer.start_tasks(PDMeshConnectorMetadata(recvs=[named(consumer, RecvTask(
        request_id="d-1", pdmesh_request_id="mesh-1", transfer_id="lw-1", kv_address=producer.producer.server.address,
        block_indexes=[0, 1, 2], local_block_ids=[1, 2, 3], token_ids=TOKENS, layerwise=True))]))
    producer.start_tasks(PDMeshConnectorMetadata(layerwise_steps=[step]))
    for name in producer.caches:
        producer.layer_saved(name)
    producer.step_saved()
    deadline = time.monotonic() + 10
    while (received := consumer.get_finished()[1]) is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert received == {"d-1"} and consumer.take_failed_block_ids() == set()
    assert all(same_block(consumer, producer, local, remote) for local, remote in [(1, 5), (2, 2), (3, 7)])
    consumer.consumer._layerwise_pool.shutdown(wait=True)  # its release is sent
    wait_until = time.monotonic() + 5
    while not producer.producer.held._released_early and time.monotonic() < wait_until:
        time.sleep(0.01)
    producer.start_tasks(PDMeshConnectorMetadata(sends=[named(producer, SendTask("lw-1", [5, 2, 7], TOKENS,
                                                                 engine_request_id="p-1"))]))
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
    monkeypatch.setattr(consumer.consumer, "_receive", lambda task: cores_of.setdefault(task.request_id,
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
    producer = make_worker(model_dir, True, "grpc")
    try:
        step = LayerwiseStep("lw-2", "mesh-2", [5, 2, 7], 0, len(TOKENS), block_hashes=names(producer, TOKENS))
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
    producer.start_tasks(PDMeshConnectorMetadata(sends=[named(producer, SendTask("p-1", [5, 2, 7], TOKENS))]))
    task = recv_task(producer, [1, 4, 6])
    task.token_ids = TOKENS[:40] + [999] + TOKENS[41:]  # differs inside block 1
    named(consumer, task)   # named as the consumer's scheduler side names the tokens it claims
    finish(consumer, PDMeshConnectorMetadata(recvs=[task]))
    assert consumer.take_failed_block_ids() == {4, 6}  # block 0 is good and kept
    assert same_block(consumer, producer, 1, 5)
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
    producer.start_tasks(PDMeshConnectorMetadata(sends=[named(producer, SendTask("p-1", [5, 2, 7], TOKENS, engine_request_id="e-1"))]))
    started = time.monotonic()
    try:
        finish(consumer, PDMeshConnectorMetadata(recvs=[recv_task(producer, [1, 4, 6])]))
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
    producer.start_tasks(PDMeshConnectorMetadata(sends=[named(producer, SendTask("p-1", [5, 2, 7], TOKENS))]))
    finish(consumer, PDMeshConnectorMetadata(recvs=[recv_task(producer, [1, 4, 6], mesh_id="tamper-1")]))
    assert consumer.take_failed_block_ids() == {1, 4, 6}  # the first block was altered: nothing is kept
    stats = consumer.take_worker_meta().stats if consumer.get_finished()[1] else {}
    assert stats["d-1"]["num_blocks"] == 0


def test_without_the_checksum_altered_kv_lands_unnoticed(pair):
    """The control: the same alteration with the check off goes through, and the cache holds other
    bytes than the producer's (what the e2e control turns into different tokens)."""
    producer, consumer, _ = pair
    producer.start_tasks(PDMeshConnectorMetadata(sends=[named(producer, SendTask("p-1", [5, 2, 7], TOKENS))]))
    finish(consumer, PDMeshConnectorMetadata(recvs=[recv_task(producer, [1, 4, 6],
                                                                 mesh_id="tamper-unverified-1")]))
    assert consumer.take_failed_block_ids() == set()
    assert not same_block(consumer, producer, 1, 5)


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
    producer.start_tasks(PDMeshConnectorMetadata(sends=[named(producer, SendTask("p-1", [5, 2, 7], TOKENS))]))
    finish(consumer, PDMeshConnectorMetadata(recvs=[recv_task(producer, [1, 4, 6])]))
    assert consumer.take_failed_block_ids() == {4, 6}
    assert consumer.get_finished() == (None, {"d-1"})
    stats = consumer.take_worker_meta().stats["d-1"]
    assert (stats["num_blocks"], stats["num_failed_blocks"], stats["num_reused_tokens"]) == (1, 2, 32)
    assert same_block(consumer, producer, 1, 5)
    assert producer.get_finished() == ({"p-1"}, None)  # released all the same


def test_a_guessed_transfer_id_reads_nothing(pair):
    producer, consumer, _ = pair
    producer.producer.servicer._wait_timeout_s = 0.2
    producer.start_tasks(PDMeshConnectorMetadata(sends=[named(producer, SendTask("p-1", [5, 2, 7], TOKENS))]))
    finish(consumer, PDMeshConnectorMetadata(recvs=[recv_task(producer, [1, 4, 6], transfer_id="p-2")]))
    assert consumer.take_failed_block_ids() == {1, 4, 6}
    assert not consumer.caches["l0"][1].any()
    assert producer.counters()["num_held_transfers"] == 1  # the guessed release freed nothing



def test_the_cache_salt_is_part_of_the_blocks_hashes(pair):
    """Another tenant's salt names other blocks: a consumer salted differently refuses them all."""
    producer, consumer, _ = pair
    send = named(producer, SendTask("p-1", [5, 2, 7], TOKENS, extra_key=b"tenant-a"))
    producer.start_tasks(PDMeshConnectorMetadata(sends=[send]))
    task = recv_task(producer, [1, 4, 6])
    task.extra_key = b"tenant-b"
    named(consumer, task)   # the consumer's scheduler side names the tokens under its request's salt
    finish(consumer, PDMeshConnectorMetadata(recvs=[task]))
    assert consumer.take_failed_block_ids() == {1, 4, 6}


def test_a_read_of_a_minted_transfer_that_arrives_before_its_hold_waits_for_it(pair):
    """The scheduler mints a pull-flow id when the request is first scheduled and tells the workers with
    that step; the hold comes a step after the request finished. A read in between waits for the hold
    (a read of an id never minted is refused at once: test_a_guessed_transfer_id_reads_nothing)."""
    producer, consumer, _ = pair
    producer.start_tasks(PDMeshConnectorMetadata(minted_transfer_ids=["p-1"]))
    consumer.start_tasks(PDMeshConnectorMetadata(recvs=[recv_task(producer, [1, 4, 6])]))
    time.sleep(0.2)  # the consumer's read is at the producer, waiting
    producer.start_tasks(PDMeshConnectorMetadata(sends=[named(producer, SendTask("p-1", [5, 2, 7], TOKENS))]))
    consumer.consumer.pool.shutdown(wait=True)
    assert consumer.take_failed_block_ids() == set()
    assert all(same_block(consumer, producer, local, remote) for remote, local in zip([5, 2, 7], [1, 4, 6]))


def test_a_minted_transfer_whose_request_ended_unheld_fails_its_read_at_once(pair):
    producer, consumer, _ = pair
    producer.start_tasks(PDMeshConnectorMetadata(minted_transfer_ids=["p-1"]))
    producer.start_tasks(PDMeshConnectorMetadata(unheld_transfer_ids=["p-1"]))
    started = time.monotonic()
    finish(consumer, PDMeshConnectorMetadata(recvs=[recv_task(producer, [1, 4, 6])]))
    assert time.monotonic() - started < 5 and consumer.take_failed_block_ids() == {1, 4, 6}


def test_pulls_from_a_producer_that_never_answers_leave_threads_for_the_others(model_dir, no_thread_leak):
    """Before: two threads served every pull of a consumer and every handshake went through one lock:
    two reads of a producer that takes connections and never answers stopped all reads for their timeout."""
    producer, consumer = make_worker(model_dir, True, "grpc"), make_worker(model_dir, False, "grpc", pull_timeout_s=2)
    try:
        producer.start_tasks(PDMeshConnectorMetadata(sends=[named(producer, SendTask("p-1", [5, 2, 7], TOKENS))]))
        with blackholed_address() as dead:
            stuck = [named(consumer, RecvTask(request_id=f"d-dead-{n}", pdmesh_request_id="m",
                                              transfer_id=f"t-dead-{n}", kv_address=dead, block_indexes=[0],
                                              local_block_ids=[n], token_ids=TOKENS[:BLOCK_SIZE]))
                     for n in (0, 2)]
            started = time.monotonic()
            consumer.start_tasks(PDMeshConnectorMetadata(recvs=[*stuck, recv_task(producer, [1, 4, 6])]))
            received: set[str] = set()
            while "d-1" not in received and time.monotonic() - started < 10:
                received |= consumer.get_finished()[1] or set()
                time.sleep(0.01)
            took = time.monotonic() - started
            consumer.consumer.pool.shutdown(wait=True)  # the dead producer's reads time out
        assert received == {"d-1"} and took < 1.0, f"{sorted(received)} after {took:.2f} s"
        assert consumer.take_failed_block_ids() == {0, 2}
        assert all(same_block(consumer, producer, local, remote) for remote, local in zip([5, 2, 7], [1, 4, 6]))
    finally:
        consumer.shutdown()
        producer.shutdown()

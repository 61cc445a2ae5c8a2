"""The connector's KV store path without vLLM: producers save finished prompts' blocks into their
stores (real tiers, a real Redis index), load them back locally and fetch them from each other
through each real transport (shared memory, Mooncake over TCP, gRPC): the node exports them and the
other reads them like a prefill's KV. Corrupt, mislabeled and missing blocks become failed block ids
(recomputed by vLLM), and no export is left held."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time

import pytest
import torch

from kvstore import store_agent
from kvstore.block_key import block_keys
from kvstore.disk_tier import find_block
from kvstore.store_lookup import StoreLookup
from pdmesh.compat import fingerprint_seed
from pdmesh.config import KVTransportSettings, StoreSettings, TelemetrySettings
from pdmesh.errors import TransferNotFound
from pdmesh.kv.tasks import SendTask, StoreLoadTask
from tests.kv_task_names import named, names
from tests.kvstore.factories import flip_bit
from worker.metadata import PDMeshConnectorMetadata
from worker.worker_side import ConnectorWorker

BLOCK_SIZE, NUM_BLOCKS = 32, 8
TOKENS = list(range(3, 3 + 80))  # 2 full blocks and a partial one
BLOCK_NBYTES = 2 * 2 * BLOCK_SIZE * 16 * 4
TRANSPORTS = ["shm", "mooncake", "grpc"]


def _producer(model_dir, store: StoreSettings, transport: str = "auto") -> ConnectorWorker:
    worker = ConnectorWorker(model=str(model_dir), block_size=BLOCK_SIZE, is_producer=True, kv_host="127.0.0.1",
                             kv_port=0, hold_timeout_s=60, pull_timeout_s=10, telemetry=TelemetrySettings(),
                             store=store, transport=KVTransportSettings(kv_transport=transport, mooncake_host="127.0.0.1"))
    worker.caches = {f"l{i}": torch.randn(NUM_BLOCKS, 2, BLOCK_SIZE, 16) for i in range(2)}
    worker.register_kv_caches(worker.caches, NUM_BLOCKS)
    return worker


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    return tmp_path


@contextlib.contextmanager
def _pair(model_dir, tmp_path, redis_server, transport: str = "auto"):
    def settings(name: str) -> StoreSettings:
        return StoreSettings(device_bytes=0, dram_bytes=4 * BLOCK_NBYTES, nvme_bytes=4 * BLOCK_NBYTES,
                             nvme_dir=tmp_path / name, redis_url=redis_server.url,
                             redis_password=redis_server.password, export_bytes=3 * BLOCK_NBYTES)

    a, b = _producer(model_dir, settings("a"), transport), _producer(model_dir, settings("b"), transport)
    yield a, b
    for worker in (a, b):
        assert worker.store.counters()["kv_store_pinned_blocks"] == 0
        assert _eventually(lambda: worker.store.exports.num_held == 0)  # no export left held (released unawaited)
        worker.shutdown()


@pytest.fixture
def producers(model_dir, tmp_path, redis_server, no_thread_leak):
    with _pair(model_dir, tmp_path, redis_server) as pair:
        yield pair


@pytest.fixture(params=TRANSPORTS)
def nodes(request, model_dir, tmp_path, redis_server, no_thread_leak):
    """Two producers whose stores read each other's exports over one transport."""
    with _pair(model_dir, tmp_path, redis_server, request.param) as (a, b):
        yield a, b, request.param


def _save(worker: ConnectorWorker, block_ids: list[int]) -> None:
    worker.start_tasks(PDMeshConnectorMetadata(sends=[named(worker, SendTask("p-1", block_ids, TOKENS))]))
    assert worker.saver.flush(timeout_s=10)


def _load(worker: ConnectorWorker, nodes: list[str], local_block_ids: list[int],
          budget_s: float = float("inf")) -> dict:
    """Runs a store load (budgeted as the scheduler side would); returns its stats as the worker
    reports them to the scheduler."""
    task = StoreLoadTask(request_id="r-2", pdmesh_request_id="mesh-2", token_ids=TOKENS[:64], extra_key=b"",
                         block_hashes=names(worker, TOKENS[:64]), block_indexes=[0, 1],
                         local_block_ids=local_block_ids, nodes=nodes, budget_s=budget_s)
    worker._load(task)
    assert worker.get_finished() == (None, {"r-2"})
    return worker.take_worker_meta().stats["r-2"]


def _same_block(dst: ConnectorWorker, dst_id: int, src: ConnectorWorker, src_id: int) -> bool:
    return all(torch.equal(dst.caches[name][dst_id], src.caches[name][src_id]) for name in src.caches)


def test_a_finished_prompt_is_copied_out_once_and_unpinned_before_the_store_writes_it(producers):
    a, _ = producers
    writing, may_write = threading.Event(), threading.Event()
    put_rows = a.store.put_rows

    def slow_put_rows(keys, rows):  # a store busy demoting and fsyncing
        writing.set()
        assert may_write.wait(10)
        return put_rows(keys, rows)

    a.store.put_rows = slow_put_rows
    a.start_tasks(PDMeshConnectorMetadata(sends=[named(a, SendTask("p-1", [5, 2, 7], TOKENS))]))
    assert writing.wait(10)  # copied out; the write has not happened yet
    a.caches["l0"][5].zero_()  # vLLM reuses the block once decode released it
    a.producer.held.release("p-1")
    assert a.get_finished() == ({"p-1"}, None)  # decode's release alone frees the blocks: no lease left
    assert (a.counters()["num_held_transfers"], a.counters()["kv_store_saves_pending"]) == (0, 1)  # still writing
    may_write.set()
    assert a.saver.flush(timeout_s=10)
    counters = a.counters()
    assert (counters["kv_store_blocks_saved"], counters["kv_store_occupancy_bytes"], counters["kv_store_saves_pending"]
            ) == (2, {"dram": 2 * BLOCK_NBYTES, "nvme": 0}, 0)  # full blocks only
    stats = _load(a, ["", ""], [0, 1])
    assert stats["tokens_by_tier"] == {"dram": 64}
    assert not torch.equal(a.caches["l0"][0], a.caches["l0"][5])  # the store kept the copy, not the reused block


def test_a_saved_prompt_keeps_its_head_longest_though_only_its_tail_was_new(producers):
    a, _ = producers
    a.start_tasks(PDMeshConnectorMetadata(sends=[named(a, SendTask("p-0", [5], TOKENS[:BLOCK_SIZE]))]))
    assert a.saver.flush(timeout_s=10)
    _save(a, [5, 2, 7])   # block 0 held already: only block 1 is written
    head, tail = (key.block_hash for key in _keys(a))
    assert a.store.store.blocks_in("dram") == [tail, head]   # least recently used first: the tail goes first


def test_saves_past_the_queue_limit_are_skipped_and_counted_and_never_wait(model_dir, tmp_path, no_thread_leak):
    worker = _producer(model_dir, StoreSettings(device_bytes=0, dram_bytes=8 * BLOCK_NBYTES, nvme_bytes=0,
                                                save_queue_bytes=3 * BLOCK_NBYTES))
    may_write = threading.Event()
    put_rows = worker.store.put_rows
    worker.store.put_rows = lambda keys, rows: may_write.wait(10) and put_rows(keys, rows)
    try:
        # 2 full blocks, then 2 more: over 3
        worker.start_tasks(PDMeshConnectorMetadata(sends=[named(worker, SendTask("p-1", [5, 2, 7], TOKENS))]))
        worker.start_tasks(PDMeshConnectorMetadata(sends=[named(worker, SendTask("p-2", [1, 3], TOKENS[:64]))]))
        counters = worker.counters()
        assert (counters["kv_store_saves_skipped"], counters["kv_store_blocks_skipped"]) == (1, 2)
        may_write.set()
        assert worker.saver.flush(timeout_s=10)
        assert worker.counters()["kv_store_blocks_saved"] == 2
    finally:
        worker.shutdown()


def test_blocks_load_back_locally_and_from_another_node(nodes):
    a, b, transport = nodes
    _save(a, [5, 2, 7])
    assert _load(a, ["", ""], [0, 1])["tokens_by_tier"] == {"dram": 64}
    assert _same_block(a, 0, a, 5) and _same_block(a, 1, a, 2)
    stats = _load(b, [a.store.index.node] * 2, [3, 4])
    assert _same_block(b, 3, a, 5) and _same_block(b, 4, a, 2)
    assert (stats["tokens_by_tier"], stats["num_bytes"], stats["num_failed_blocks"], stats["transport"]) == (
        {"remote": 64}, 2 * BLOCK_NBYTES, 0, transport)
    assert b.take_failed_block_ids() == set()
    assert b.counters()["kv_store_hit_blocks"] == {"remote": 2}
    assert a.counters()["kv_bytes_sent_by_transport"] == {transport: 2 * BLOCK_NBYTES}  # the export, read once


def test_the_lookup_sees_local_then_remote_blocks(producers):
    a, b = producers
    _save(a, [5, 2, 7])
    lookup = StoreLookup(b.producer.server.address, BLOCK_SIZE, timeout_s=5)
    assert lookup.nodes_of_cached_prefix(TOKENS, names(b, TOKENS)) == [a.store.index.node] * 2
    # the last token is computed
    assert lookup.nodes_of_cached_prefix(TOKENS[:64], names(b, TOKENS[:64])) == [a.store.index.node]
    assert lookup.nodes_of_cached_prefix(TOKENS, names(b, TOKENS, b"tenant-x")) == []
    lookup.close()


def test_a_bit_flipped_on_nvme_fails_that_block_and_keeps_the_prefix(producers, tmp_path):
    a, _ = producers
    _save(a, [5, 2, 7])
    assert a.store.store.spill("nvme") == 2
    path, offset = find_block(tmp_path / "a", _keys(a)[1].block_hash, a.store.store.block_nbytes)  # the prompt's tail
    flip_bit(path, offset + 100, 0x01)
    assert _load(a, ["", ""], [0, 1])["tokens_by_tier"] == {"nvme": 32}
    assert a.take_failed_block_ids() == {1}
    counters = a.counters()
    assert (counters["kv_store_corrupt_blocks"], counters["kv_store_failed_blocks"]) == (1, 1)


def test_a_node_that_lost_the_block_is_a_miss_not_an_error(nodes):
    a, b, _ = nodes
    _save(a, [5, 2, 7])
    a.store.store.clear()
    _load(b, [a.store.index.node] * 2, [3, 4])
    assert b.take_failed_block_ids() == {3, 4}


def test_a_node_whose_export_slab_is_full_is_computed_around(nodes):
    a, b, _ = nodes
    _save(a, [5, 2, 7])
    held = a.store.exports.export(_keys(a)).transfer  # 2 of its 3 slots
    assert held is not None
    _load(b, [a.store.index.node] * 2, [3, 4])  # needs 2 slots, 1 is free
    assert b.take_failed_block_ids() == {3, 4}
    assert a.store.exports.release(held.transfer_id)
    assert _load(b, [a.store.index.node] * 2, [3, 4])["tokens_by_tier"] == {"remote": 64}


def test_a_load_slower_than_computing_is_cut_and_the_rest_computed(producers, monkeypatch):
    monkeypatch.setattr(store_agent, "LOAD_BATCH_BLOCKS", 1)  # the budget is checked between batches
    a, _ = producers
    _save(a, [5, 2, 7])
    stats = _load(a, ["", ""], [0, 1], budget_s=64e-12)   # computing 64 tokens would take 64 ps
    assert (stats["num_blocks"], stats["num_failed_blocks"], stats["cut"]) == (1, 1, True)
    assert a.take_failed_block_ids() == {1}
    assert a.counters()["kv_store_loads_cut"] == 1


def test_a_node_that_sends_another_block_than_asked_keeps_the_prefix_before_it(nodes):
    a, b, _ = nodes
    _save(a, [5, 2, 7])
    find = a.store.exports.find

    def second_block_mislabeled(transfer_id):
        transfer = find(transfer_id)
        return transfer and dataclasses.replace(transfer, block_hashes=(transfer.block_hashes[0], b"\x00" * 16))

    a.store.exports.find = second_block_mislabeled
    stats = _load(b, [a.store.index.node] * 2, [3, 4])
    assert _same_block(b, 3, a, 5)
    assert (stats["tokens_by_tier"], stats["num_failed_blocks"]) == ({"remote": 32}, 1)
    assert b.take_failed_block_ids() == {4}


def test_an_export_is_read_by_its_transfer_id_only_and_freed_at_its_deadline(producers):
    a, b = producers
    _save(a, [5, 2, 7])
    a.producer.servicer._wait_timeout_s = 0.2
    exported = a.store.exports.export(_keys(a)).transfer
    control, address = b.store._links.control, a.producer.server.address
    with pytest.raises(TransferNotFound):
        control.open(address, "guessed", [0], "grpc")
    assert not control.release_soon(address, "guessed").result().released
    assert [bytes(block.payload) for block in control.pull(address, exported.transfer_id, [0, 1])] == [
        a.store.store.read(key)[0].tobytes() for key in _keys(a)]
    a.store.exports._hold_s = 0.0  # a reader that never releases
    expired = a.store.exports.export(_keys(a)[:1]).transfer
    assert (a.store.exports.num_held, a.store.exports.num_expired) == (1, 1)  # the first is still held
    started = time.monotonic()
    with pytest.raises(TransferNotFound, match="released or expired"):  # answered at once, not waited for
        control.open(address, expired.transfer_id, [0], "grpc")
    assert time.monotonic() - started < 0.15
    assert control.release_soon(address, exported.transfer_id).result().released


def _eventually(predicate, timeout_s: float = 5.0) -> bool:
    """Releases are sent without waiting for the answer: what they free is freed a moment later."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _keys(worker: ConnectorWorker):
    return block_keys(fingerprint_seed(worker.compat), TOKENS, BLOCK_SIZE)


def test_a_remote_load_reads_batch_after_batch_and_frees_the_one_exported_ahead_when_cut(nodes, monkeypatch):
    monkeypatch.setattr(store_agent, "EXPORT_BATCH_NBYTES", BLOCK_NBYTES)  # one block an export
    a, b, _ = nodes
    _save(a, [5, 2, 7])
    assert _load(b, [a.store.index.node] * 2, [3, 4])["tokens_by_tier"] == {"remote": 64}
    assert _same_block(b, 3, a, 5) and _same_block(b, 4, a, 2)
    stats = _load(b, [a.store.index.node] * 2, [6, 1], budget_s=64e-12)   # computing is free: cut after a batch
    assert (stats["num_blocks"], stats["cut"]) == (1, True)
    assert _eventually(lambda: a.store.exports.num_held == 0)  # the second block, exported ahead, was released


def test_a_read_ahead_export_with_no_room_is_asked_again_once_the_batch_before_is_released(nodes, monkeypatch):
    monkeypatch.setattr(store_agent, "EXPORT_BATCH_NBYTES", BLOCK_NBYTES)  # one block an export
    a, b, _ = nodes
    _save(a, [5, 2, 7])
    held = a.store.exports.export(_keys(a)).transfer  # 2 of its 3 slots: room for one batch at a time
    stats = _load(b, [a.store.index.node] * 2, [3, 4])
    assert (stats["tokens_by_tier"], stats["num_failed_blocks"]) == ({"remote": 64}, 0)
    assert _same_block(b, 4, a, 2)
    assert a.store.exports.release(held.transfer_id)


def test_a_release_the_node_does_not_answer_holds_up_no_load(producers, monkeypatch):
    """A Release left unanswered (in a soak one was, for the whole timeout, on both of a worker's
    transfer threads at once, and every load on that worker waited): the load finishes without it."""
    a, b = producers
    _save(a, [5, 2, 7])
    answer = threading.Event()
    release = a.store.exports.release
    monkeypatch.setattr(a.store.exports, "release", lambda transfer_id: answer.wait(30) and release(transfer_id))
    loaded: list[dict] = []
    loading = threading.Thread(target=lambda: loaded.append(_load(b, [a.store.index.node] * 2, [3, 4])))
    loading.start()
    loading.join(timeout=10)
    try:
        assert not loading.is_alive()
        assert loaded[0]["tokens_by_tier"] == {"remote": 64}
        assert a.store.exports.num_held == 1   # its release is still on its way
    finally:
        answer.set()
        loading.join()
    assert _eventually(lambda: a.store.exports.num_held == 0)

"""The connector's KV store path without vLLM: producers save finished prompts' blocks into their
stores (real tiers, a real Redis index), load them back locally and fetch them from each other
over real gRPC; corrupt and missing blocks become failed block ids (recomputed by vLLM)."""

from __future__ import annotations

import pytest
import torch

from pdmesh.config import StoreSettings, TelemetrySettings
from pdmesh.connector.metadata import PDMeshConnectorMetadata, SendTask, StoreLoadTask
from pdmesh.connector.store_lookup import StoreLookup
from pdmesh.connector.worker_side import ConnectorWorker

BLOCK_SIZE, NUM_BLOCKS = 32, 8
TOKENS = list(range(3, 3 + 80))  # 2 full blocks and a partial one
BLOCK_NBYTES = 2 * 2 * BLOCK_SIZE * 16 * 4


def _producer(model_dir, store: StoreSettings) -> ConnectorWorker:
    worker = ConnectorWorker(model=str(model_dir), block_size=BLOCK_SIZE, is_producer=True, kv_host="127.0.0.1",
                             kv_port=0, hold_timeout_s=60, pull_timeout_s=10, telemetry=TelemetrySettings(),
                             store=store)
    worker.caches = {f"l{i}": torch.randn(NUM_BLOCKS, 2, BLOCK_SIZE, 16) for i in range(2)}
    worker.register_kv_caches(worker.caches, NUM_BLOCKS)
    return worker


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    return tmp_path


@pytest.fixture
def producers(model_dir, tmp_path, redis_server, no_thread_leak):
    def settings(name: str) -> StoreSettings:
        return StoreSettings(device_bytes=0, dram_bytes=4 * BLOCK_NBYTES, nvme_bytes=4 * BLOCK_NBYTES,
                             nvme_dir=tmp_path / name, redis_url=redis_server.url,
                             redis_password=redis_server.password)

    a, b = _producer(model_dir, settings("a")), _producer(model_dir, settings("b"))
    yield a, b
    for worker in (a, b):
        assert worker.store.counters()["kv_store_pinned_blocks"] == 0
        worker.shutdown()


def _save(worker: ConnectorWorker, block_ids: list[int]) -> None:
    worker.start_tasks(PDMeshConnectorMetadata(sends=[SendTask("p-1", block_ids, TOKENS)]))
    worker._save_pool.submit(lambda: None).result(timeout=10)  # the save ran (one thread, in order)


def _load(worker: ConnectorWorker, nodes: list[str], local_block_ids: list[int]) -> StoreLoadTask:
    task = StoreLoadTask(request_id="r-2", pdmesh_request_id="mesh-2", token_ids=TOKENS[:64], extra_key=b"",
                         block_indexes=[0, 1], local_block_ids=local_block_ids, nodes=nodes)
    worker._load(task)
    return task


def _same_block(dst: ConnectorWorker, dst_id: int, src: ConnectorWorker, src_id: int) -> bool:
    return all(torch.equal(dst.caches[name][dst_id], src.caches[name][src_id]) for name in src.caches)


def test_a_finished_prompt_is_saved_while_pinned_and_freed_only_after_the_save(producers):
    a, _ = producers
    a.held.lease("p-1")  # stands for a save still running
    a.start_tasks(PDMeshConnectorMetadata(sends=[SendTask("p-1", [5, 2, 7], TOKENS)]))
    a._save_pool.submit(lambda: None).result(timeout=10)
    a.held.release("p-1")
    assert a.get_finished() == (None, None)  # still leased: vLLM must not free the blocks yet
    a.held.unlease("p-1")
    assert a.get_finished() == ({"p-1"}, None)
    counters = a.counters()
    assert (counters["kv_store_blocks_saved"], counters["kv_store_occupancy_bytes"]) == (
        2, {"dram": 2 * BLOCK_NBYTES, "nvme": 0})  # full blocks only


def test_blocks_load_back_locally_and_from_another_node(producers):
    a, b = producers
    _save(a, [5, 2, 7])
    _load(a, ["", ""], [0, 1])
    assert _same_block(a, 0, a, 5) and _same_block(a, 1, a, 2)
    assert a.store.stats_for("mesh-2")["tokens_by_tier"] == {"dram": 64}
    _load(b, [a.store.index.node] * 2, [3, 4])
    assert _same_block(b, 3, a, 5) and _same_block(b, 4, a, 2)
    stats = b.store.stats_for("mesh-2")
    assert (stats["tokens_by_tier"], stats["num_bytes"], stats["num_failed_blocks"]) == ({"remote": 64},
                                                                                        2 * BLOCK_NBYTES, 0)
    assert b.get_finished() == (None, {"r-2"})
    assert b.take_failed_block_ids() == set()
    assert b.counters()["kv_store_hit_blocks"] == {"remote": 2}


def test_the_lookup_sees_local_then_remote_blocks(producers):
    a, b = producers
    _save(a, [5, 2, 7])
    lookup = StoreLookup(b._server.address, BLOCK_SIZE, timeout_s=5)
    assert lookup.nodes_of_cached_prefix(TOKENS, b"") == [a.store.index.node] * 2
    assert lookup.nodes_of_cached_prefix(TOKENS[:64], b"") == [a.store.index.node]  # last token is computed
    assert lookup.nodes_of_cached_prefix(TOKENS, b"tenant-x") == []
    lookup.close()


def test_a_bit_flipped_on_nvme_fails_that_block_and_keeps_the_prefix(producers, tmp_path):
    a, _ = producers
    _save(a, [5, 2, 7])
    assert a.store.store.spill("nvme") == 2
    files = sorted((tmp_path / "a").glob("*.blk"), key=lambda p: p.stat().st_mtime_ns)
    second = next(p for p in files if p.name.startswith(a.store.store.blocks_in("nvme")[1].hex()))
    data = bytearray(second.read_bytes())
    data[-100] ^= 0x01
    second.write_bytes(bytes(data))
    _load(a, ["", ""], [0, 1])
    assert a.take_failed_block_ids() == {1}
    assert a.store.stats_for("mesh-2")["tokens_by_tier"] == {"nvme": 32}
    counters = a.counters()
    assert (counters["kv_store_corrupt_blocks"], counters["kv_store_failed_blocks"]) == (1, 1)


def test_a_node_that_lost_the_block_is_a_miss_not_an_error(producers):
    a, b = producers
    _save(a, [5, 2, 7])
    a.store.store.clear()
    _load(b, [a.store.index.node] * 2, [3, 4])
    assert b.take_failed_block_ids() == {3, 4}
    assert b.get_finished() == (None, {"r-2"})

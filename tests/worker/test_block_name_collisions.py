"""A prompt whose block names collide with a cached prompt's gets none of its KV through the
connector's store path: real stores, a real Redis index, real gRPC between two prefill nodes,
names colliding on purpose (tests/kvstore/colliding_names.py). The index and the lookup go by
names alone and so plan the load; the stores compare token ids and refuse it."""

from __future__ import annotations

import pytest
import torch

from kvstore.block_key import block_keys
from kvstore.store_lookup import StoreLookup
from pdmesh.compat import fingerprint_seed
from pdmesh.kv import block_hash
from pdmesh.kv.tasks import StoreLoadTask
from tests.kv_task_names import names
from tests.kvstore.colliding_names import tokens_ignored
from tests.kvstore.test_store_agent import BLOCK_SIZE, TOKENS, _pair, _save
from worker.worker_side import ConnectorWorker

OTHER_TOKENS = [token + 1000 for token in TOKENS]   # as long as TOKENS: every name the same


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    return tmp_path


@pytest.fixture
def colliding_nodes(model_dir, tmp_path, redis_server, no_thread_leak, monkeypatch):
    """Two prefill nodes naming blocks by `tokens_ignored`; the first has saved TOKENS' blocks."""
    monkeypatch.setattr(block_hash, "block_name", tokens_ignored)
    with _pair(model_dir, tmp_path, redis_server) as (a, b):
        _save(a, [5, 2, 7])
        seed = fingerprint_seed(a.compat)
        assert ([key.block_hash for key in block_keys(seed, OTHER_TOKENS, BLOCK_SIZE)]
                == [key.block_hash for key in block_keys(seed, TOKENS, BLOCK_SIZE)])
        yield a, b


def _load(worker: ConnectorWorker, token_ids: list[int], nodes: list[str], local_block_ids: list[int]) -> dict:
    task = StoreLoadTask(request_id="r-2", pdmesh_request_id="mesh-2", token_ids=token_ids, extra_key=b"",
                         block_hashes=names(worker, token_ids),
                         block_indexes=[0, 1], local_block_ids=local_block_ids, nodes=nodes)
    worker._load(task)
    assert worker.get_finished() == (None, {"r-2"})
    return worker.take_worker_meta().stats["r-2"]


def _snapshot(worker: ConnectorWorker, block_ids: list[int]) -> list[torch.Tensor]:
    return [worker.caches[name][block_id].clone() for name in worker.caches for block_id in block_ids]


def test_a_local_load_of_a_colliding_prompt_writes_nothing(colliding_nodes):
    a, _ = colliding_nodes
    before = _snapshot(a, [0, 1])
    stats = _load(a, OTHER_TOKENS[:64], ["", ""], [0, 1])
    assert (stats["num_blocks"], stats["num_failed_blocks"], a.take_failed_block_ids()) == (0, 2, {0, 1})
    assert all(torch.equal(x, y) for x, y in zip(before, _snapshot(a, [0, 1])))
    assert _load(a, TOKENS[:64], ["", ""], [0, 1])["tokens_by_tier"] == {"dram": 64}   # its own prompt loads


def test_another_node_is_planned_by_name_but_exports_nothing_for_a_colliding_prompt(colliding_nodes):
    a, b = colliding_nodes
    lookup = StoreLookup(b.producer.server.address, BLOCK_SIZE, timeout_s=5)
    try:
        assert lookup.nodes_of_cached_prefix(OTHER_TOKENS, names(b, OTHER_TOKENS)) == [a.store.index.node] * 2   # the index: names
    finally:
        lookup.close()
    before = _snapshot(b, [3, 4])
    stats = _load(b, OTHER_TOKENS[:64], [a.store.index.node] * 2, [3, 4])
    assert (stats["num_blocks"], stats["num_failed_blocks"], b.take_failed_block_ids()) == (0, 2, {3, 4})
    assert all(torch.equal(x, y) for x, y in zip(before, _snapshot(b, [3, 4])))
    assert _load(b, TOKENS[:64], [a.store.index.node] * 2, [3, 4])["tokens_by_tier"] == {"remote": 64}

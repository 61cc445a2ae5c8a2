"""Block names (pdmesh/kv/block_hash.py) where they cross tenants: SHA-256, and a store that never
trusts a name alone. A real xxh3-128 collision is impractical to build here, so the store's paths
run under a name function that collides on purpose (colliding_names.py): each must still give a
second prompt none of the first's blocks. And names of the xxh3 era are never read as today's: an
NVMe tier written before is emptied at start, an index written before is in another namespace."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore import disk_tier
from kvstore.block_store import TieredBlockStore
from kvstore.redis_index import IndexEntry, RedisBlockIndex
from kvstore.slab_tier import host_tier
from kvstore.store_events import BlockPlaced
from kvstore.store_export import StoreExports
from pdmesh import compat
from pdmesh.kv import block_hash
from pdmesh.kv.block_hash import HASH_NBYTES
from tests.kvstore.colliding_names import tokens_ignored
from tests.kvstore.factories import BLOCK_NBYTES, keys, payload, three_tier_store


@pytest.fixture
def colliding_names(monkeypatch):
    monkeypatch.setattr(block_hash, "block_name", tokens_ignored)
    first, second = keys(2, first_token=0), keys(2, first_token=1000)
    assert [k.block_hash for k in first] == [k.block_hash for k in second]   # the names collide
    return first, second


def _store_holding(keys_held) -> TieredBlockStore:
    store = TieredBlockStore([host_tier(4 * BLOCK_NBYTES, BLOCK_NBYTES)], BLOCK_NBYTES)
    for i, key in enumerate(keys_held):
        assert store.put(key, payload(i))
    return store


def test_a_store_lookup_never_answers_another_prompts_block_under_its_name(colliding_names):
    first, second = colliding_names
    store = _store_holding(first)
    assert store.longest_prefix(second) == 0
    assert not store.has(second[0])
    rows, tiers = store.read_prefix(second)
    assert (len(rows), tiers) == (0, [])
    assert store.read(second[1]) is None


def test_a_store_keeps_the_block_it_has_when_another_prompt_brings_the_same_name(colliding_names):
    first, second = colliding_names
    store = _store_holding(first)
    assert store.put_many(second, np.full((2, BLOCK_NBYTES), 0xEE, dtype=np.uint8)) == 0
    assert [bytes(store.read(key)[0]) for key in first] == [payload(0), payload(1)]


def test_a_prompt_sharing_the_first_block_hits_that_block_only(colliding_names):
    first, _ = colliding_names
    store = _store_holding(first)
    same_head = keys(2, first_token=0)[:1] + keys(2, first_token=1000)[1:]
    assert same_head[1].block_hash == first[1].block_hash
    assert store.longest_prefix(same_head) == 1


def test_nvme_blocks_recovered_after_a_restart_are_still_checked_by_their_tokens(colliding_names, tmp_path):
    first, second = colliding_names
    store = three_tier_store(tmp_path, nvme_blocks=4)
    for i, key in enumerate(first):
        store.put(key, payload(i))
    assert store.spill("nvme") == 2
    store.close()
    restarted = three_tier_store(tmp_path, nvme_blocks=4)
    assert (restarted.longest_prefix(second), restarted.longest_prefix(first)) == (0, 2)
    restarted.close()


def test_an_export_to_another_node_holds_nothing_for_another_prompt(colliding_names):
    first, second = colliding_names
    exports = StoreExports(_store_holding(first), [(1, BLOCK_NBYTES)], 2 * BLOCK_NBYTES, hold_s=60)
    try:
        exported = exports.export(second)
        assert (exported.transfer, exported.tiers, exports.num_held) == (None, [], 0)
    finally:
        exports.close()


def test_an_nvme_tier_written_under_xxh3_names_is_emptied_at_start(tmp_path, monkeypatch):
    with monkeypatch.context() as before:
        before.setattr(disk_tier, "VERSION", 2)   # the journal format of the xxh3-128 names (any older one)
        old = three_tier_store(tmp_path, nvme_blocks=4)
        for i, key in enumerate(keys(2)):
            old.put(key, payload(i))
        assert old.spill("nvme") == 2
        old.close()
    restarted = three_tier_store(tmp_path, nvme_blocks=4)
    assert (restarted.num_blocks, restarted.longest_prefix(keys(2))) == (0, 0)
    assert (tmp_path / disk_tier.JOURNAL_NAME).stat().st_size == 0
    restarted.close()


def test_an_index_written_under_xxh3_names_is_another_namespace(redis_server, tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with monkeypatch.context() as before:
        before.setattr(compat, "LAYOUT_VERSION", 1)   # the xxh3-128 names
        old_fingerprint = compat.model_fingerprint(tmp_path, "float32", 32)
    fingerprint = compat.model_fingerprint(tmp_path, "float32", 32)
    old, new = (RedisBlockIndex.connect(redis_server.url, redis_server.password, namespace, node, ttl_s=60)
                for namespace, node in ((old_fingerprint, "old:1"), (fingerprint, "new:1")))
    name = b"\x42" * HASH_NBYTES
    old.on_events([BlockPlaced(name, "dram", BLOCK_NBYTES, 7)])
    assert (old.probe([name]), new.probe([name])) == ([IndexEntry("old:1", "dram")], [None])
    old.close()
    new.close()

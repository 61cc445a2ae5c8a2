"""The shared index against a real redis-server (password required)."""

import redis

from kvstore.block_store import TieredBlockStore
from kvstore.redis_index import IndexEntry, RedisBlockIndex
from kvstore.slab_tier import host_tier
from tests.kvstore.factories import BLOCK_NBYTES, keys, payload


def _index(server, node: str, password: str | None = "s3cret") -> RedisBlockIndex:
    return RedisBlockIndex.connect(server.url, password, namespace="fp-test", node=node, ttl_s=60)


def test_a_store_mirrors_its_blocks_into_the_index_and_one_probe_reads_them(redis_server):
    index = _index(redis_server, "10.0.0.1:7000")
    store = TieredBlockStore([host_tier(2 * BLOCK_NBYTES, BLOCK_NBYTES)], BLOCK_NBYTES, listener=index)
    k = keys(3)
    for i, key in enumerate(k):
        store.put(key, payload(i))  # the third evicts the first
    hashes = [key.block_hash for key in k]
    assert index.probe(hashes) == [None, IndexEntry("10.0.0.1:7000", "dram"), IndexEntry("10.0.0.1:7000", "dram")]
    fields = redis_server.client().hgetall(index.key_of(hashes[1]))
    assert (fields[b"nbytes"], fields[b"tier"]) == (str(BLOCK_NBYTES).encode(), b"dram")
    assert 0 < redis_server.client().ttl(index.key_of(hashes[1])) <= 60
    index.close()


def test_a_node_never_deletes_the_entry_another_node_took_over(redis_server):
    mine, theirs = _index(redis_server, "a:1"), _index(redis_server, "b:2")
    store = TieredBlockStore([host_tier(1 * BLOCK_NBYTES, BLOCK_NBYTES)], BLOCK_NBYTES, listener=mine)
    k = keys(2)
    store.put(k[0], payload(0))
    TieredBlockStore([host_tier(1 * BLOCK_NBYTES, BLOCK_NBYTES)], BLOCK_NBYTES, listener=theirs).put(k[0], payload(0))
    store.put(k[1], payload(1))  # evicts k[0] here; the index still names b:2
    assert mine.probe([k[0].block_hash]) == [IndexEntry("b:2", "dram")]
    mine.close()
    theirs.close()


def test_redis_down_or_wrong_password_degrades_to_misses(redis_server):
    wrong = _index(redis_server, "a:1", password="nope")
    assert wrong.probe([keys(1)[0].block_hash]) == [None]
    wrong.on_events([])
    index = _index(redis_server, "a:1")
    TieredBlockStore([host_tier(BLOCK_NBYTES, BLOCK_NBYTES)], BLOCK_NBYTES, listener=index).put(keys(1)[0], payload(0))
    redis_server.stop()
    assert index.probe([keys(1)[0].block_hash]) == [None]
    assert (wrong.num_errors, index.num_errors) == (1, 1)
    redis_server.start()
    assert index.probe([keys(1)[0].block_hash]) == [None]  # restarted empty: a miss, nothing wrong
    wrong.close()
    index.close()


def test_probing_a_long_prefix_is_one_round_trip(redis_server, monkeypatch):
    index = _index(redis_server, "a:1")
    index.probe([keys(1)[0].block_hash])  # connects (handshake) first
    hmgets_before = _calls(redis_server, "hmget")
    sends = []
    real_send = redis.connection.Connection.send_packed_command
    monkeypatch.setattr(redis.connection.Connection, "send_packed_command",
                        lambda self, command, check_health=True: sends.append(1) or real_send(self, command, check_health))
    assert index.probe([key.block_hash for key in keys(64)]) == [None] * 64
    monkeypatch.undo()
    assert (len(sends), _calls(redis_server, "hmget") - hmgets_before) == (1, 64)
    index.close()


def _calls(server, command: str) -> int:
    return int(server.client().info("commandstats").get(f"cmdstat_{command}", {}).get("calls", 0))

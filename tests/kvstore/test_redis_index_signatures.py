"""Attacks on the shared block index by someone who can write to its Redis but does not hold the mesh
token (a real redis-server): entries pointing a prompt's blocks at the attacker's node, a genuine
entry edited or copied under another block's key. With the token, the worker's prefix lookup never
names the attacker's node, and each entry it ignored is counted."""

from __future__ import annotations

from kvstore.block_store import TieredBlockStore
from kvstore.prefix_lookup import BlockSource, find_prefix
from kvstore.redis_index import IndexEntry, RedisBlockIndex
from kvstore.slab_tier import host_tier
from tests.kvstore.factories import BLOCK_NBYTES, keys, payload

TOKEN = "mesh-secret-of-this-deployment"
GENUINE, READER, ATTACKER = "10.0.0.1:7000", "10.0.0.2:7000", "203.0.113.66:7000"


def _index(server, node: str, mesh_token: str | None = TOKEN) -> RedisBlockIndex:
    return RedisBlockIndex.connect(server.url, server.password, namespace="fp-test", node=node, ttl_s=60,
                                   mesh_token=mesh_token)


def _store(listener: RedisBlockIndex | None = None, num_blocks: int = 8) -> TieredBlockStore:
    return TieredBlockStore([host_tier(num_blocks * BLOCK_NBYTES, BLOCK_NBYTES)], BLOCK_NBYTES, listener=listener)


def _forge(server, key: str, **fields) -> None:
    """What the attacker writes: an entry shaped like a real one (its own `sig`, or none)."""
    client = server.client()
    client.hset(key, mapping={"node": ATTACKER, "tier": "dram", "nbytes": BLOCK_NBYTES, "checksum": 0,
                              "last_use": 1.0} | fields)
    client.close()


def _lookup(reader: RedisBlockIndex, num_blocks: int) -> list[BlockSource]:
    """The worker's own prefix lookup (what its KV store's Lookup answers), from a node holding nothing."""
    return find_prefix(_store(), reader, keys(num_blocks), include_remote=True)


def test_a_forged_entry_never_points_a_prompt_at_an_attackers_node(redis_server):
    genuine = _index(redis_server, GENUINE)
    store = _store(genuine)
    k = keys(4)
    for i in (0, 1):
        store.put(k[i], payload(i))
    reader = _index(redis_server, READER)
    _forge(redis_server, reader.key_of(k[2].block_hash), sig="0" * 64)   # a made-up signature
    _forge(redis_server, reader.key_of(k[3].block_hash), sig=b"\xff" * 64)  # not even text
    assert reader.probe([key.block_hash for key in k]) == [IndexEntry(GENUINE, "dram")] * 2 + [None, None]
    assert reader.num_rejected == 2
    assert _lookup(reader, 4) == [BlockSource(GENUINE, "dram")] * 2
    assert reader.num_rejected == 4                                       # counted at every read that meets them
    _forge(redis_server, reader.key_of(k[0].block_hash))                  # none, over the head of the prompt
    assert _lookup(reader, 4) == []
    assert (reader.num_rejected, reader.num_errors) == (7, 0)
    for index in (genuine, reader):
        index.close()


def test_a_genuine_entry_edited_or_copied_under_another_block_is_ignored(redis_server):
    genuine = _index(redis_server, GENUINE)
    store = _store(genuine)
    k = keys(3)
    for i in (0, 1):
        store.put(k[i], payload(i))
    attacker = redis_server.client()
    reader = _index(redis_server, READER)
    attacker.hset(reader.key_of(k[1].block_hash), "node", ATTACKER)      # its signature kept
    attacker.hset(reader.key_of(k[2].block_hash), mapping=attacker.hgetall(reader.key_of(k[0].block_hash)))
    assert reader.probe([key.block_hash for key in k]) == [IndexEntry(GENUINE, "dram"), None, None]
    assert reader.num_rejected == 2
    assert _lookup(reader, 3) == [BlockSource(GENUINE, "dram")]
    attacker.close()
    for index in (genuine, reader):
        index.close()


def test_signed_entries_read_without_the_token_and_not_with_another_meshs(redis_server):
    genuine = _index(redis_server, GENUINE)
    _store(genuine).put(keys(1)[0], payload(0))
    unsigned_reader, other_mesh = _index(redis_server, READER, None), _index(redis_server, READER, "another-mesh")
    block = [keys(1)[0].block_hash]
    assert unsigned_reader.probe(block) == [IndexEntry(GENUINE, "dram")]
    assert (other_mesh.probe(block), other_mesh.num_rejected) == ([None], 1)
    fields = redis_server.client().hgetall(genuine.key_of(block[0]))
    assert sorted(fields) == [b"checksum", b"last_use", b"nbytes", b"node", b"sig", b"tier"]
    for index in (genuine, unsigned_reader, other_mesh):
        index.close()

"""Attacks on the registry by someone who can write to its Redis but does not hold the mesh token
(a real redis-server): a forged worker, a forged load for a real worker, a genuine record replayed
under another key. With the token, the watcher ignores each and counts it; the workers' own signed
records still read, and a gateway without the token still reads them (the signature is one more field)."""

from __future__ import annotations

import json

from pdmesh.config import RegistrySettings
from pdmesh.registry import RegistryPublisher, RegistryWatcher, WorkerLoad, WorkerRecord, encode_record
from pdmesh.registry.keys import index_key, record_key

PREFIX = "pdmesh:workers"
SLOW = 30.0  # no heartbeat or poll fires within a test: only explicit beats and reads count
TOKEN = "mesh-secret-of-this-deployment"
GENUINE = "10.0.0.1:50051"
ATTACKER = "203.0.113.66:50051"
ATTACKER_2 = "203.0.113.67:50051"


def _settings(server) -> RegistrySettings:
    return RegistrySettings(redis_url=server.url, redis_password=server.password, heartbeat_s=SLOW, ttl_s=SLOW,
                            poll_s=SLOW, prefix=PREFIX)


def _record(role: str = "decode", address: str = GENUINE, **overrides) -> WorkerRecord:
    fields = dict(role=role, address=address, kv_address="10.0.0.1:7000" if role == "prefill" else "",
                  model="tiny-llama", model_fingerprint="fp-1234", max_num_seqs=64, num_kv_blocks=512)
    return WorkerRecord(**(fields | overrides))


async def _genuine(server, load: WorkerLoad) -> RegistryPublisher:
    """A real worker's publisher, signing with the mesh token, busy with `load`."""
    publisher = RegistryPublisher(_settings(server), _record(), lambda: load, mesh_token=TOKEN)
    await publisher.start()
    return publisher


def _plant(server, key: str, value: str) -> None:
    """What the attacker does: a value under a key, listed in the registry's index set, no TTL."""
    client = server.client()
    client.set(key, value)
    client.sadd(index_key(PREFIX), key)
    client.close()


async def _watch(server, mesh_token: str | None = TOKEN) -> RegistryWatcher:
    watcher = RegistryWatcher(_settings(server), mesh_token)
    await watcher.start()
    return watcher


async def test_a_forged_worker_pointing_at_an_attackers_server_is_not_listed(redis_server):
    publisher = await _genuine(redis_server, WorkerLoad(num_running=5))
    forged = json.loads(encode_record(_record(address=ATTACKER))) | {"signature": "0" * 64}
    _plant(redis_server, record_key(PREFIX, "decode", ATTACKER), json.dumps(forged))
    _plant(redis_server, record_key(PREFIX, "prefill", ATTACKER),
           encode_record(_record("prefill", ATTACKER, kv_address=ATTACKER)))   # no signature at all
    watcher = await _watch(redis_server)
    assert [r.address for r in watcher.snapshot()] == [GENUINE]
    assert (watcher.num_rejected, watcher.num_malformed) == (2, 0)
    assert await watcher.refresh()
    assert watcher.num_rejected == 4   # counted at every read that meets them
    await publisher.stop()
    await watcher.stop()


async def test_a_forged_low_load_for_a_real_workers_address_is_ignored(redis_server):
    publisher = await _genuine(redis_server, WorkerLoad(num_running=40, num_waiting=12, kv_cache_usage=0.9))
    idle = json.loads(redis_server.client().get(publisher.key)) | {"num_running": 0, "num_waiting": 0,
                                                                    "kv_cache_usage": 0.0}
    _plant(redis_server, record_key(PREFIX, "decode", "zz-after-the-real-key"), json.dumps(idle))  # its own key
    watcher = await _watch(redis_server)
    assert [(r.address, r.num_running, r.num_waiting) for r in watcher.snapshot()] == [(GENUINE, 40, 12)]
    assert watcher.num_rejected == 1

    _plant(redis_server, publisher.key, json.dumps(idle))   # over the worker's own record, its signature kept
    assert await watcher.refresh()
    assert (watcher.snapshot(), watcher.num_rejected) == ([], 3)
    assert await publisher.beat()                           # the worker's next beat puts the truth back
    assert await watcher.refresh()
    assert [(r.address, r.num_running) for r in watcher.snapshot()] == [(GENUINE, 40)]
    await publisher.stop()
    await watcher.stop()


async def test_a_genuine_record_replayed_under_another_key_is_ignored(redis_server):
    publisher = await _genuine(redis_server, WorkerLoad())
    genuine = redis_server.client().get(publisher.key)
    _plant(redis_server, record_key(PREFIX, "decode", ATTACKER), genuine)          # verbatim: outlives the worker
    _plant(redis_server, record_key(PREFIX, "prefill", GENUINE), genuine)          # as another role
    readdressed = json.loads(genuine) | {"address": ATTACKER_2}                     # its signature, another address
    _plant(redis_server, record_key(PREFIX, "decode", ATTACKER_2), json.dumps(readdressed))
    watcher = await _watch(redis_server)
    assert [(r.role, r.address) for r in watcher.snapshot()] == [("decode", GENUINE)]
    assert watcher.num_rejected == 3
    await publisher.stop(deregister=True)
    assert await watcher.refresh()
    assert (watcher.snapshot(), watcher.num_rejected) == ([], 6)  # the replays do not keep a gone worker listed
    await watcher.stop()


async def test_a_signed_record_is_stored_as_readable_json_and_read_with_or_without_the_token(redis_server):
    publisher = await _genuine(redis_server, WorkerLoad(num_running=3))
    stored = json.loads(redis_server.client().get(publisher.key))
    assert len(bytes.fromhex(stored.pop("signature"))) == 32   # HMAC-SHA256
    assert stored == json.loads(encode_record(publisher.record))
    with_token, without = await _watch(redis_server), await _watch(redis_server, mesh_token=None)
    assert with_token.snapshot() == without.snapshot() == [publisher.record]
    other_mesh = await _watch(redis_server, mesh_token="another-deployment")
    assert (other_mesh.snapshot(), other_mesh.num_rejected) == ([], 1)
    await publisher.stop()
    for watcher in (with_token, without, other_mesh):
        await watcher.stop()

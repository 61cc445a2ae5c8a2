"""The gateway against someone who can write to its Redis but does not hold the mesh token (a real
redis-server, in-process fake workers over real gRPC): a forged idle decode worker at the attacker's
address is never dialled, so no user's tokens stream from it; forged KV index entries do not steer
prefix-aware routing. Both are counted in the gateway's metrics."""

from __future__ import annotations

import json

from gateway.prefix_index import PrefixIndex
from gateway.prompt_names import PromptNames
from gateway.server import Gateway
from kvstore.block_key import block_keys
from kvstore.redis_index import RedisBlockIndex
from kvstore.store_events import BlockPlaced
from pdmesh.client import generate, make_request
from pdmesh.compat import fingerprint_seed
from pdmesh.config import GatewaySettings, RegistrySettings
from pdmesh.registry import RegistryPublisher, WorkerLoad, WorkerRecord, encode_record
from pdmesh.registry.keys import index_key, record_key
from tests.gateway.fake_workers import COMPAT, FakeWorker

TOKEN = "mesh-secret-of-this-deployment"
SLOW = 30.0  # no heartbeat or poll fires within a test: the gateway reads the registry once, at start
PROMPT = list(range(3, 3 + 200))   # 6 full blocks of 32 + 8 tokens


def _registry(server) -> RegistrySettings:
    return RegistrySettings(redis_url=server.url, redis_password=server.password, heartbeat_s=SLOW, ttl_s=SLOW,
                            poll_s=SLOW)


def _record(role: str, address: str, kv_address: str = "") -> WorkerRecord:
    return WorkerRecord(role=role, address=address, kv_address=kv_address, model="tiny-llama",
                        model_fingerprint=COMPAT.model_fingerprint, max_num_seqs=64, num_kv_blocks=512)


async def _publish(server, role: str, worker: FakeWorker, load: WorkerLoad) -> RegistryPublisher:
    address = await worker.server.start("127.0.0.1", 0)
    publisher = RegistryPublisher(_registry(server), _record(role, address, worker.kv_address), lambda: load,
                                  mesh_token=TOKEN)
    await publisher.start()
    return publisher


async def _forge_worker(server, worker: FakeWorker) -> None:
    """The attacker's server, listed as an idle decode worker under its own key (no valid signature)."""
    address = await worker.server.start("127.0.0.1", 0)
    settings = _registry(server)
    key = record_key(settings.prefix, "decode", address)
    client = server.client()
    client.set(key, json.dumps(json.loads(encode_record(_record("decode", address))) | {"signature": "0" * 64}))
    client.sadd(index_key(settings.prefix), key)
    client.close()


async def test_a_forged_idle_decode_worker_never_receives_a_request(redis_server, tiny_llama_dir):
    prefill, decode, attacker = FakeWorker("prefill"), FakeWorker("decode"), FakeWorker("decode")
    publishers = [await _publish(redis_server, "prefill", prefill, WorkerLoad()),
                  await _publish(redis_server, "decode", decode, WorkerLoad(num_running=40, kv_cache_usage=0.5))]
    await _forge_worker(redis_server, attacker)
    gateway = Gateway(GatewaySettings(port=0, tokenizer=str(tiny_llama_dir), registry=_registry(redis_server),
                                      route_policy="least_loaded", mesh_token=TOKEN))
    address = await gateway.start()
    for i in range(4):
        token_ids, _, _ = await generate(address, make_request([0, 7, 9], max_tokens=2, request_id=f"r{i}"))
        assert token_ids == [0, 7]
    assert (attacker.num_info_calls, attacker.requests, len(decode.requests)) == (0, [], 4)
    assert gateway.metrics.registry.get_sample_value(
        "pdmesh_redis_rejected_entries", {"role": "gateway", "source": "registry"}) == 1
    await gateway.stop(0)
    for publisher in publishers:
        await publisher.stop()
    for worker in (prefill, decode, attacker):
        await worker.server.stop(0)


async def test_forged_index_entries_do_not_steer_prefix_aware_routing(redis_server):
    keys = block_keys(fingerprint_seed(COMPAT), PROMPT, 32, b"tenant-salt")
    genuine = RedisBlockIndex.connect(redis_server.url, redis_server.password, COMPAT.model_fingerprint,
                                      node="kv-a", ttl_s=60, mesh_token=TOKEN)
    genuine.on_events([BlockPlaced(k.block_hash, "dram", 1024, 0) for k in keys[:2]])
    attacker = redis_server.client()
    for key in keys[2:]:
        attacker.hset(genuine.key_of(key.block_hash), mapping={"node": "kv-evil", "tier": "dram", "nbytes": 1024,
                                                               "checksum": 0, "last_use": 1.0, "sig": "0" * 64})
    index = PrefixIndex(redis_server.url, redis_server.password, mesh_token=TOKEN)
    try:
        assert await index.holders(COMPAT, PromptNames(PROMPT, "tenant-salt")) == ["kv-a"] * 2
        assert index.num_rejected == 4
    finally:
        index.close()
        genuine.close()
        attacker.close()

"""The registry's reads scale with workers, not with the database: found through its index set, never
a SCAN, with 100k KV index keys beside it (what `pdmesh up --redis-url` shares one database with)."""

from __future__ import annotations

from redis import asyncio as aioredis

from pdmesh.config import RegistrySettings
from pdmesh.registry import RegistryPublisher, RegistryWatcher, WorkerRecord, encode_record
from pdmesh.registry.keys import index_key, read_records, record_key

PREFIX = "pdmesh:workers"
NUM_KV_KEYS = 100_000


def _settings(server) -> RegistrySettings:
    return RegistrySettings(redis_url=server.url, redis_password=server.password, heartbeat_s=30.0, ttl_s=30.0,
                            poll_s=30.0, prefix=PREFIX)


def _record(role: str, address: str) -> WorkerRecord:
    return WorkerRecord(role=role, address=address, kv_address="10.0.0.1:7000" if role == "prefill" else "",
                        model="tiny-llama", model_fingerprint="fp", max_num_seqs=64, num_kv_blocks=512)


def _fill_kv_index(client, num_keys: int) -> None:
    """Keys shaped like the KV store's block index (and some under the registry's own prefix)."""
    pipe = client.pipeline(transaction=False)
    for i in range(num_keys):
        prefix = f"{PREFIX}:stale" if i % 1000 == 0 else "pdmesh:kv:tiny-llama"
        pipe.set(f"{prefix}:{i:064x}", b"x" * 40)
        if i % 10_000 == 9_999:
            pipe.execute()
    pipe.execute()


def _commands(client) -> dict[str, int]:
    return {name.removeprefix("cmdstat_"): stats["calls"] for name, stats in client.info("commandstats").items()}


async def test_a_read_is_smembers_and_mget_whatever_else_the_database_holds(redis_server):
    direct = redis_server.client()
    _fill_kv_index(direct, NUM_KV_KEYS)
    settings = _settings(redis_server)
    publishers = [RegistryPublisher(settings, _record(role, f"10.0.0.{i}:5005{i}"))
                  for i, role in enumerate(["prefill", "prefill", "decode"])]
    for publisher in publishers:
        await publisher.start()
    watcher = RegistryWatcher(settings)
    await watcher.start()
    direct.config_resetstat()
    assert await watcher.refresh()
    assert [r.address for r in watcher.snapshot()] == ["10.0.0.0:50050", "10.0.0.1:50051", "10.0.0.2:50052"]
    commands = _commands(direct)
    assert (commands.get("smembers"), commands.get("mget"), "scan" in commands, "keys" in commands) == (
        1, 1, False, False)
    assert direct.dbsize() == NUM_KV_KEYS + 3 + 1  # the records and their index
    for publisher in publishers:
        await publisher.stop()
    await watcher.stop()
    direct.close()


async def test_an_expired_record_leaves_the_index_but_one_written_again_meanwhile_stays(redis_server):
    direct = redis_server.client()
    gone, back = record_key(PREFIX, "decode", "10.0.0.8:1"), record_key(PREFIX, "decode", "10.0.0.9:1")
    direct.sadd(index_key(PREFIX), gone, back)  # both records expired (no value)...
    client = aioredis.Redis.from_url(redis_server.url, password=redis_server.password)
    mget = client.mget

    async def mget_then_rewrite(keys):
        values = await mget(keys)  # ...and one worker writes its record again right after the read
        direct.set(back, encode_record(_record("decode", "10.0.0.9:1")))
        return values

    client.mget = mget_then_rewrite
    assert await read_records(client, PREFIX) == {}
    assert direct.smembers(index_key(PREFIX)) == {back.encode()}  # the cleanup re-checked each key
    assert list(await read_records(client, PREFIX)) == [back]
    await client.aclose()
    direct.close()

"""Where the registry lives in Redis, and the three operations on it.

- `<prefix>:<role>:<address>`: a worker's record, with the TTL that makes a crashed worker vanish.
- `<prefix>:index`: the set of those keys, so a read is SMEMBERS + MGET (O(workers)), never a SCAN
  of a keyspace that may hold millions of KV index keys.
A record and its index entry are written and deleted together (MULTI); a reader drops the entries
of records that expired, in one script that re-checks each key, so a worker that came back between
the read and the cleanup keeps its entry.
"""

from __future__ import annotations

import redis.asyncio as aioredis

MGET_BATCH = 1000
_DROP_EXPIRED = """
local dropped = 0
for i = 2, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 0 then dropped = dropped + redis.call('SREM', KEYS[1], KEYS[i]) end
end
return dropped
"""


def record_key(prefix: str, role: str, address: str) -> str:
    return f"{prefix}:{role}:{address}"


def index_key(prefix: str) -> str:
    return f"{prefix}:index"


async def write_record(client: aioredis.Redis, prefix: str, key: str, value: str, ttl_ms: int) -> None:
    async with client.pipeline(transaction=True) as pipe:
        pipe.set(key, value, px=ttl_ms)
        pipe.sadd(index_key(prefix), key)
        await pipe.execute()


async def delete_record(client: aioredis.Redis, prefix: str, key: str) -> None:
    async with client.pipeline(transaction=True) as pipe:
        pipe.delete(key)
        pipe.srem(index_key(prefix), key)
        await pipe.execute()


async def read_records(client: aioredis.Redis, prefix: str) -> dict[str, bytes]:
    """Every live record (key → stored value); the index entries of expired ones are dropped."""
    keys = sorted(await client.smembers(index_key(prefix)))
    values: dict[str, bytes] = {}
    expired: list[bytes] = []
    for start in range(0, len(keys), MGET_BATCH):
        batch = keys[start:start + MGET_BATCH]
        for key, value in zip(batch, await client.mget(batch)):
            if value is None:
                expired.append(key)
            else:
                values[key.decode(errors="replace")] = value
    if expired:
        await client.eval(_DROP_EXPIRED, 1 + len(expired), index_key(prefix), *expired)
    return values

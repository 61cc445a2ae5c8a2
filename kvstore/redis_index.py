"""The block index every worker shares, in Redis: block hash → where a copy lives.

One Redis hash per block, `<prefix>:<model fingerprint>:<block hash hex>`, with fields node
(the holder's store address), tier, nbytes, checksum and last_use; each key expires after
`ttl_s` unless refreshed, so a node that vanished stops being advertised. Writes and probes are
pipelined: one round trip per batch, never one per block.

Redis is a cache of the truth, not the truth: a key it lost is a miss; a key that names a node
that no longer holds the block is a miss when that node is asked. Every Redis error is logged,
counted and turned into "nothing known" — never into an error for the request.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import redis

from kvstore.store_events import BlockDropped, BlockPlaced, StoreEvent

logger = logging.getLogger(__name__)

# Deletes a block's key only while it still names this node (another node may have taken it over).
_DELETE_IF_MINE = """
if redis.call('HGET', KEYS[1], 'node') == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


@dataclass(frozen=True)
class IndexEntry:
    node: str
    tier: str


class RedisBlockIndex:
    def __init__(self, client: redis.Redis, namespace: str, node: str, ttl_s: int = 3600,
                 prefix: str = "pdmesh:kv") -> None:
        self._client = client
        self._key_prefix = f"{prefix}:{namespace}:"
        self.node = node
        self._ttl_s = ttl_s
        self._delete_if_mine = client.register_script(_DELETE_IF_MINE)
        self.num_errors = 0

    @classmethod
    def connect(cls, url: str, password: str | None, namespace: str, node: str, ttl_s: int,
                timeout_s: float = 0.5) -> "RedisBlockIndex":
        client = redis.Redis.from_url(url, password=password or None, socket_timeout=timeout_s,
                                      socket_connect_timeout=timeout_s)
        return cls(client, namespace, node, ttl_s)

    def key_of(self, block_hash: bytes) -> str:
        return self._key_prefix + block_hash.hex()

    def on_events(self, events: list[StoreEvent]) -> None:
        """Mirrors the local store's changes (one pipelined round trip)."""
        now = time.time()
        try:
            pipe = self._client.pipeline(transaction=False)
            for event in events:
                key = self.key_of(event.block_hash)
                if isinstance(event, BlockPlaced):
                    pipe.hset(key, mapping={"node": self.node, "tier": event.tier, "nbytes": event.nbytes,
                                            "checksum": event.checksum, "last_use": now})
                    pipe.expire(key, self._ttl_s)
                elif isinstance(event, BlockDropped):
                    self._delete_if_mine(keys=[key], args=[self.node], client=pipe)
            pipe.execute()
        except redis.RedisError as exc:
            self._failed("publish", exc)

    def probe(self, block_hashes: Sequence[bytes]) -> list[IndexEntry | None]:
        """Where each block lives, one round trip; all None when Redis cannot answer."""
        if not block_hashes:
            return []
        try:
            pipe = self._client.pipeline(transaction=False)
            for block_hash in block_hashes:
                pipe.hmget(self.key_of(block_hash), "node", "tier")
            rows = pipe.execute()
        except redis.RedisError as exc:
            self._failed("probe", exc)
            return [None] * len(block_hashes)
        return [IndexEntry(node.decode(), tier.decode()) if node and tier else None for node, tier in rows]

    def close(self) -> None:
        self._client.close()

    def _failed(self, what: str, exc: redis.RedisError) -> None:
        self.num_errors += 1
        logger.warning("redis index %s failed (%s); treating as a miss", what, exc)

"""The block index every worker shares, in Redis: block hash → where a copy lives.

One Redis hash per block, `<prefix>:<model fingerprint>:<block hash hex>`, with fields node
(the holder's store address), tier, nbytes, checksum and last_use; each key expires after
`ttl_s` unless refreshed, so a node that vanished stops being advertised. Writes and probes are
pipelined: one round trip per batch, never one per block.

Redis is a cache of the truth, not the truth: a key it lost is a miss; a key that names a node
that no longer holds the block is a miss when that node is asked. Every Redis error is logged,
counted and turned into "nothing known" — never into an error for the request.

With the mesh token each entry also holds `sig`, the signature of its fields and its key
(pdmesh/mesh_signing.py): an entry without it, or with a wrong one, is a miss, counted in
num_rejected — a write to Redis alone cannot point a prompt at a node outside the mesh.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import redis

from kvstore.store_events import BlockDropped, BlockPlaced, StoreEvent
from pdmesh.mesh_signing import KV_INDEX_PURPOSE, signer_for

logger = logging.getLogger(__name__)

# Deletes a block's key only while it still names this node (another node may have taken it over).
_DELETE_IF_MINE = """
if redis.call('HGET', KEYS[1], 'node') == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
SIGNED_FIELDS = ("node", "tier", "nbytes", "checksum", "last_use")   # stored as strings, as signed
SIGNATURE_FIELD = "sig"


@dataclass(frozen=True)
class IndexEntry:
    node: str
    tier: str


class RedisBlockIndex:
    def __init__(self, client: redis.Redis, namespace: str, node: str, ttl_s: int = 3600,
                 prefix: str = "pdmesh:kv", mesh_token: str | None = None) -> None:
        """mesh_token: signs the entries written and is required of the entries read; None: unsigned."""
        self._client = client
        self._signer = signer_for(mesh_token, KV_INDEX_PURPOSE)
        self._key_prefix = f"{prefix}:{namespace}:"
        self.node = node
        self._ttl_s = ttl_s
        self._delete_if_mine = client.register_script(_DELETE_IF_MINE)
        self.num_errors = 0
        self.num_rejected = 0        # entries read and not believed (missing or wrong signature)

    @classmethod
    def connect(cls, url: str, password: str | None, namespace: str, node: str, ttl_s: int,
                timeout_s: float = 0.5, mesh_token: str | None = None) -> "RedisBlockIndex":
        client = redis.Redis.from_url(url, password=password or None, socket_timeout=timeout_s,
                                      socket_connect_timeout=timeout_s)
        return cls(client, namespace, node, ttl_s, mesh_token=mesh_token)

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
                    pipe.hset(key, mapping=self._entry(key, event, now))
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
                pipe.hmget(self.key_of(block_hash), *SIGNED_FIELDS, SIGNATURE_FIELD)
            rows = pipe.execute()
        except redis.RedisError as exc:
            self._failed("probe", exc)
            return [None] * len(block_hashes)
        return [self._believed(self.key_of(block_hash), row) for block_hash, row in zip(block_hashes, rows)]

    def close(self) -> None:
        self._client.close()

    def _entry(self, key: str, event: BlockPlaced, now: float) -> dict[str, str]:
        """The fields stored for a placed block, as the strings Redis keeps, signed with the key."""
        fields = dict(zip(SIGNED_FIELDS, (self.node, event.tier, str(event.nbytes), str(event.checksum), repr(now))))
        if self._signer is not None:
            fields[SIGNATURE_FIELD] = self._signer.sign(key, fields)
        return fields

    def _believed(self, key: str, row: list[bytes | None]) -> IndexEntry | None:
        """The entry a probe read, or None: absent, or (with a signer) unsigned or wrongly signed."""
        *values, signature = [None if value is None else value.decode(errors="replace") for value in row]
        fields = dict(zip(SIGNED_FIELDS, values))
        if not fields["node"] or not fields["tier"]:
            return None
        if self._signer is not None and (None in values or not self._signer.verify(key, fields, signature)):
            self._rejected(key)
            return None
        return IndexEntry(fields["node"], fields["tier"])

    def _rejected(self, key: str) -> None:
        self.num_rejected += 1
        if self.num_rejected == 1:
            logger.warning("redis index: ignoring an entry without a valid signature under %s (a writer outside "
                           "the mesh, or a worker with another mesh token); further ones are only counted", key)

    def _failed(self, what: str, exc: redis.RedisError) -> None:
        self.num_errors += 1
        logger.warning("redis index %s failed (%s); treating as a miss", what, exc)

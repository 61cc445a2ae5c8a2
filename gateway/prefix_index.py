"""What the KV store's Redis index knows about a prompt, as the gateway sees it: for each leading
full block, the prefill node (its KV address) holding a copy. kvstore names the blocks (its own
key scheme, seeded by the model fingerprint, with the request's cache salt: a tenant's salt keeps
its prefix invisible to another tenant's routing too); this keeps one index per model."""

from __future__ import annotations

import asyncio

from gateway.prompt_names import PromptNames
from kvstore.prompt_holders import prompt_holders
from kvstore.redis_index import RedisBlockIndex
from pdmesh.v1 import common_pb2


class PrefixIndex:
    def __init__(self, redis_url: str, password: str | None = None, timeout_s: float = 0.2,
                 mesh_token: str | None = None) -> None:
        """mesh_token: entries must carry the workers' signature (unsigned ones are ignored, counted)."""
        self._url = redis_url
        self._password = password
        self._mesh_token = mesh_token
        self._timeout_s = timeout_s
        self._indexes: dict[str, RedisBlockIndex] = {}   # model fingerprint: its index

    async def holders(self, compat: common_pb2.CompatInfo, prompt: PromptNames) -> list[str]:
        """The node holding each block of the longest indexed prefix (one Redis round trip;
        [] when Redis cannot answer: routing then ignores the cache)."""
        names = prompt.of(compat)
        if not names:
            return []
        return await asyncio.to_thread(prompt_holders, self._index(compat), names)

    @property
    def num_rejected(self) -> int:
        """Entries read and ignored for a missing or wrong signature, over every model's index."""
        return sum(index.num_rejected for index in list(self._indexes.values()))

    def close(self) -> None:
        for index in self._indexes.values():
            index.close()

    def _index(self, compat: common_pb2.CompatInfo) -> RedisBlockIndex:
        fingerprint = compat.model_fingerprint
        if fingerprint not in self._indexes:
            self._indexes[fingerprint] = RedisBlockIndex.connect(
                self._url, self._password, namespace=fingerprint, node="gateway", ttl_s=0, timeout_s=self._timeout_s,
                mesh_token=self._mesh_token)
        return self._indexes[fingerprint]

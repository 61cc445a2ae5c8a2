"""A request's prompt, with its blocks' names hashed once: the names the workers give them
(pdmesh/kv/block_hash.py: seeded by the model fingerprint, at the engines' block size, salted with
the request's cache salt). Routing looks them up in the KV store's index; conditional
disaggregation in what each engine's prefix cache likely holds (gateway/seen_prefixes.py)."""

from __future__ import annotations

from collections.abc import Sequence

from pdmesh.compat import fingerprint_seed
from pdmesh.kv.block_hash import chain_block_hashes, salt_extra_key
from pdmesh.v1 import common_pb2


class PromptNames:
    def __init__(self, token_ids: Sequence[int], cache_salt: str = "") -> None:
        self.token_ids = token_ids
        self.cache_salt = cache_salt
        self._names: dict[tuple[str, int], list[bytes]] = {}   # (model fingerprint, block size): names
        self.num_hashed = 0

    def __len__(self) -> int:
        return len(self.token_ids)

    def of(self, compat: common_pb2.CompatInfo) -> list[bytes]:
        """The names of the prompt's full blocks, as engines of `compat`'s model name them."""
        key = (compat.model_fingerprint, compat.block_size)
        if key not in self._names:
            self.num_hashed += 1
            self._names[key] = chain_block_hashes(fingerprint_seed(compat), self.token_ids, compat.block_size,
                                                  salt_extra_key(self.cache_salt))
        return self._names[key]

"""Scheduler side of the KV store: asks the engine's own store (in the worker process, over
its KVStore service) how much of a prompt is cached, locally or on other nodes."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from kvstore.client import GrpcStoreClient
from pdmesh.errors import PDMeshError

logger = logging.getLogger(__name__)


def num_loadable_blocks(num_prompt_tokens: int, block_size: int) -> int:
    """Full blocks that may be loaded: the last prompt token is always computed (it yields the logits)."""
    return max(num_prompt_tokens - 1, 0) // block_size


class StoreLookup:
    def __init__(self, store_address: str, block_size: int, timeout_s: float) -> None:
        self._store_address = store_address
        self._block_size = block_size
        self._timeout_s = timeout_s
        self._client = GrpcStoreClient(compat=None, timeout_s=timeout_s)

    def nodes_of_cached_prefix(self, prompt_token_ids: Sequence[int], extra_key: bytes) -> list[str]:
        """For each block of the longest cached prefix, the node holding it ("" = this one).
        Any failure is a miss: the prompt is computed."""
        num_blocks = num_loadable_blocks(len(prompt_token_ids), self._block_size)
        if num_blocks == 0:
            return []
        try:
            sources = self._client.lookup(self._store_address, prompt_token_ids[:num_blocks * self._block_size],
                                          extra_key, include_remote=True, timeout_s=self._timeout_s)
        except PDMeshError as exc:
            logger.warning("KV store lookup failed (%s); computing the prompt", exc)
            return []
        return [source.node for source in sources]

    def close(self) -> None:
        self._client.close()

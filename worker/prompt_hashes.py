"""Each request's block names, hashed once: the scheduler side names a prompt's blocks
(pdmesh/kv/block_hash.py: chained, seeded by the model fingerprint, salted) the first time the
connector needs them and carries them in the request's tasks: the store's lookup and load, the
hold and the store's save, the layer-wise publish, the consumer's check of what it pulled.
Forgotten when the request leaves the engine."""

from __future__ import annotations

from collections.abc import Sequence

from pdmesh.kv.block_hash import ROOT_PARENT, chain_block_hashes, hash_block


class PromptHashes:
    def __init__(self, seed: bytes, block_size: int) -> None:
        self._seed = seed
        self._block_size = block_size
        self._by_request: dict[str, list[bytes]] = {}   # engine request id: its whole prompt's names
        self.num_hashed = 0   # prompts (or prefixes of them) hashed: one per request is the rule

    def of(self, request_id: str, prompt_token_ids: Sequence[int], extra_key: bytes,
           num_tokens: int | None = None) -> list[bytes]:
        """The names of the blocks holding the prompt's first `num_tokens` tokens (all of them by
        default; a partial last block too)."""
        hashes = self._by_request.get(request_id)
        if hashes is None:
            hashes = self._by_request[request_id] = self._hash(prompt_token_ids, extra_key)
        num_tokens = len(prompt_token_ids) if num_tokens is None else min(num_tokens, len(prompt_token_ids))
        num_full = num_tokens // self._block_size
        if num_tokens == len(prompt_token_ids) or num_tokens % self._block_size == 0:
            return hashes[:-(-num_tokens // self._block_size)]
        # a partial block the prompt's does not end: only it is hashed, on the full blocks' chain
        parent = hashes[num_full - 1] if num_full else ROOT_PARENT
        partial = prompt_token_ids[num_full * self._block_size:num_tokens]
        return [*hashes[:num_full], hash_block(self._seed, parent, partial, extra_key)]

    def forget(self, request_id: str) -> None:
        self._by_request.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._by_request)

    def _hash(self, token_ids: Sequence[int], extra_key: bytes) -> list[bytes]:
        self.num_hashed += 1
        return chain_block_hashes(self._seed, token_ids, self._block_size, extra_key, include_partial=True)

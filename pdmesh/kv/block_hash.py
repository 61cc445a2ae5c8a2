"""Chained content hashes of token blocks: the names blocks are stored, indexed and moved under.
Deterministic across processes and restarts; never Python's randomized `hash`.

name(block i) = SHA-256(seed || name(block i-1) || extra_key || token ids as int32 LE)[:16]
(lengths before the seed and the extra key; the first block's parent is ROOT_PARENT).

The seed is the model fingerprint, so two models never share a name space; the extra key
carries the request's cache salt, so two tenants never do either. The name is cryptographic,
as vLLM's prefix cache has been since CVE-2025-25183: xxh3 is built for speed, not against
someone choosing inputs, and a name shared by two prompts would let one's KV stand in for the
other's wherever only the name is compared: a KV transfer's check (pull and layer-wise), the
Redis index, routing, and the salt everywhere (a store hit also compares parent and token ids:
kvstore/block_key.py). Truncated to 128 bits: a crafted pair of colliding prompts costs about
2^64 SHA-256 evaluations, and hitting a given prompt's name (which holds its tenant's secret
salt) about 2^128. xxh3 stays where bytes are checksummed, not named.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

HASH_NBYTES = 16  # SHA-256's first 128 bits
ROOT_PARENT = b"\x00" * HASH_NBYTES


def salt_extra_key(cache_salt: str) -> bytes:
    """A request's cache salt as the extra key of its blocks' names (what every hasher hashes with)."""
    return cache_salt.encode()


def block_name(data: bytes) -> bytes:
    """The name of one block's hashed bytes (hash_block and chain_block_hashes lay them out)."""
    return hashlib.sha256(data).digest()[:HASH_NBYTES]


def hash_block(seed: bytes, parent: bytes, token_ids: Sequence[int], extra_key: bytes = b"") -> bytes:
    """Hash of one block given its parent's hash."""
    return block_name(b"".join((len(seed).to_bytes(4, "little"), seed, parent,
                                len(extra_key).to_bytes(4, "little"), extra_key,
                                np.asarray(token_ids, dtype="<i4").tobytes())))


def chain_block_hashes(
    seed: bytes,
    token_ids: Sequence[int],
    block_size: int,
    extra_key: bytes = b"",
    include_partial: bool = False,
) -> list[bytes]:
    """Hashes of consecutive blocks of `token_ids`; the trailing partial block only if asked."""
    num_tokens = len(token_ids)
    end = num_tokens if include_partial else num_tokens - num_tokens % block_size
    # hash_block's bytes, joined once per block (one hash call each, the tokens converted once)
    head = len(seed).to_bytes(4, "little") + seed
    tail = len(extra_key).to_bytes(4, "little") + extra_key
    tokens = np.asarray(token_ids[:end], dtype="<i4").tobytes()
    hashes: list[bytes] = []
    parent = ROOT_PARENT
    for start in range(0, end * 4, block_size * 4):
        parent = block_name(b"".join((head, parent, tail, tokens[start:start + block_size * 4])))
        hashes.append(parent)
    return hashes

"""Chained content hashes of token blocks, deterministic across processes and restarts.

hash(block i) = xxh3_128(seed || hash(block i-1) || extra_key || token ids as int32 LE).
The seed is the model fingerprint, so two models never share a hash space; the extra
key carries a tenant / cache salt. Never uses Python's randomized `hash`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xxhash

HASH_NBYTES = 16
ROOT_PARENT = b"\x00" * HASH_NBYTES


def hash_block(seed: bytes, parent: bytes, token_ids: Sequence[int], extra_key: bytes = b"") -> bytes:
    """Hash of one block given its parent's hash."""
    hasher = xxhash.xxh3_128()
    hasher.update(len(seed).to_bytes(4, "little"))
    hasher.update(seed)
    hasher.update(parent)
    hasher.update(len(extra_key).to_bytes(4, "little"))
    hasher.update(extra_key)
    hasher.update(np.asarray(token_ids, dtype="<i4").tobytes())
    return hasher.digest()


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
        parent = xxhash.xxh3_128_digest(b"".join((head, parent, tail, tokens[start:start + block_size * 4])))
        hashes.append(parent)
    return hashes

"""A block name function that collides on purpose, for tests of what a store does when two
prompts share names (a real SHA-256 or even xxh3-128 collision is impractical to build)."""

from __future__ import annotations

import hashlib

from pdmesh.kv.block_hash import HASH_NBYTES


def tokens_ignored(data: bytes) -> bytes:
    """A block name blind to the block's token ids (it hashes seed, parent and salt only, as laid
    out by block_hash.hash_block): any two prompts as long as each other share every name."""
    seed_end = 4 + int.from_bytes(data[:4], "little")
    salt_at = seed_end + HASH_NBYTES
    salt_end = salt_at + 4 + int.from_bytes(data[salt_at:salt_at + 4], "little")
    return hashlib.sha256(data[:salt_end]).digest()[:HASH_NBYTES]

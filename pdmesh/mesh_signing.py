"""Signatures on what the mesh keeps in Redis: the worker registry and the KV store's block index.

Redis is shared, and whoever can write to it could otherwise list an address of theirs as a worker
(the gateway would stream users' tokens from it) or as the holder of a prompt's blocks (a prefill
would send it the prompt and the mesh token, and cache the KV it answers). So each stored entry
carries an HMAC-SHA256 of its fields and of the key it is stored under, keyed by the mesh token
through a label per purpose (a registry signature is never a valid index signature): a reader
ignores, and counts, an entry whose signature is missing or wrong, and a genuine entry copied
under another key fails too. The signature travels inside the stored value: no extra round trip.

What it does not prove: that an entry is recent. A holder of Redis can put back a worker's own
older entry under its own key (its TTL and the next heartbeat or store event overwrite it).
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Mapping

REGISTRY_PURPOSE = "pdmesh-registry-v1"
KV_INDEX_PURPOSE = "pdmesh-kv-index-v1"
_CANONICAL = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


class EntrySigner:
    """Signs and checks (Redis key, fields) pairs for one purpose; fields are JSON values."""

    def __init__(self, mesh_token: str, purpose: str) -> None:
        if not mesh_token:
            raise ValueError("a signer needs the mesh token")
        self._key = hmac.new(mesh_token.encode(), purpose.encode(), hashlib.sha256).digest()

    def sign(self, redis_key: str, fields: Mapping[str, object]) -> str:
        return hmac.digest(self._key, _canonical(redis_key, fields), "sha256").hex()

    def verify(self, redis_key: str, fields: Mapping[str, object], signature: str | None) -> bool:
        """False for a missing or wrong signature, or fields that have no canonical form (NaN)."""
        if not signature:
            return False
        try:
            expected = self.sign(redis_key, fields)
        except (TypeError, ValueError):
            return False
        return hmac.compare_digest(expected.encode(), signature.encode(errors="replace"))  # any text an attacker stored


def signer_for(mesh_token: str | None, purpose: str) -> EntrySigner | None:
    """The purpose's signer; None without a mesh token (entries are then written and read unsigned)."""
    return EntrySigner(mesh_token, purpose) if mesh_token else None


def _canonical(redis_key: str, fields: Mapping[str, object]) -> bytes:
    """One byte string per (key, fields): sorted keys, no spaces, ASCII, no NaN."""
    return _CANONICAL.encode([redis_key, fields]).encode()

"""Each request's cache salt: an HMAC, under a key only the mesh holds, of the tenant's name and
the request's own salt (vLLM's `cache_salt`).

vLLM's prefix cache, the KV store and prefix-aware routing name every block with the request's
salt, so tenants never share a cached prefix. vLLM keeps `cache_salt` secret for a reason: whoever
can compute a tenant's salt can name blocks under it — test the KV store's Redis index for that
tenant's prompts, or send it to a worker as their own. An unkeyed hash of the tenant's name is
computable by anyone who knows the name; a keyed one is not.

The key is `salt_secret`, else one derived from the mesh token, else random per process. Every
gateway of a mesh must share it: a salt that changes makes the tenant's cached prefixes (engine,
KV store, routing) invisible to the other gateways and after a restart.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import secrets

logger = logging.getLogger(__name__)
KEY_LABEL = b"pdmesh cache salt key v1"   # what the key derived from the mesh token is the HMAC of
SALT_HEX_CHARS = 32                        # 128 bits of the HMAC-SHA256


def salt_key(salt_secret: str | None, mesh_token: str | None) -> bytes:
    """The key of the salts: salt_secret, else derived from mesh_token, else random (this process only)."""
    if salt_secret:
        return salt_secret.encode()
    if mesh_token:   # derived, so the salts never reveal anything of the token itself
        return hmac.new(mesh_token.encode(), KEY_LABEL, hashlib.sha256).digest()
    logger.warning("neither salt_secret nor mesh_token is set: tenants' cache salts use a random key of this "
                   "process (cached prefixes are not found across gateways or after a restart)")
    return secrets.token_bytes(32)


class CacheSalts:
    def __init__(self, key: bytes) -> None:
        self._key = key

    def salt_of(self, tenant: str, request_salt: str = "") -> str:
        """The salt sent to the workers; empty when neither is set (no API keys: one tenant, one cache)."""
        if not tenant and not request_salt:
            return ""
        message = json.dumps([tenant, request_salt]).encode()   # unambiguous: no name runs into the other
        return hmac.new(self._key, message, hashlib.sha256).hexdigest()[:SALT_HEX_CHARS]

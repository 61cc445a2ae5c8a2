"""API keys of the gateway: `Authorization: Bearer <key>` (gRPC metadata or HTTP header) -> tenant.

Each tenant's requests carry a cache salt keyed by the mesh's secret (gateway/cache_salt.py), so vLLM's
prefix cache, the KV store and prefix-aware routing keep tenants apart: one tenant never hits another's prefix.
"""

from __future__ import annotations

import hmac

from pdmesh.errors import Unauthenticated

ANONYMOUS = ""   # the tenant of every request when no keys are configured


class ApiKeyAuth:
    def __init__(self, api_keys: dict[str, str]) -> None:
        self._tenants = dict(api_keys)   # key -> tenant

    @property
    def enabled(self) -> bool:
        return bool(self._tenants)

    def tenant_of(self, authorization: str | None) -> str:
        """The tenant of an `Authorization` value ("Bearer <key>"); Unauthenticated when missing or unknown."""
        if not self.enabled:
            return ANONYMOUS
        if not authorization:
            raise Unauthenticated("missing API key: send 'authorization: Bearer <key>'")
        scheme, _, key = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise Unauthenticated("malformed authorization: expected 'Bearer <key>'")
        key = key.strip()
        for known, tenant in self._tenants.items():
            if hmac.compare_digest(known.encode(), key.encode()):
                return tenant
        raise Unauthenticated("unknown API key")

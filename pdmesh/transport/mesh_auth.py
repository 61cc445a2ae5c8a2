"""Mesh credentials on the internal KV ports (KV transfer, KV store): a shared mesh token in call
metadata, checked by a server interceptor, and mutual TLS when the workers have certificates (the
worker's certificate serves its KV port and is its client certificate when it dials another's).
Transfer ids are per-transfer capabilities on top."""

from __future__ import annotations

import hmac
from dataclasses import dataclass, field

import grpc

from pdmesh.config import TlsSettings

MESH_TOKEN_KEY = "x-pdmesh-mesh-token"
_OPEN_METHODS = ("/grpc.health.v1.Health/", "/grpc.reflection.")  # probes carry no credentials


@dataclass(frozen=True)
class MeshAuth:
    """What a mesh peer presents on the KV ports, and what those ports require."""

    token: str | None = None
    tls: TlsSettings = field(default_factory=TlsSettings)

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """Sent on every call (none when no token is configured)."""
        return ((MESH_TOKEN_KEY, self.token),) if self.token else ()


class MeshTokenInterceptor(grpc.ServerInterceptor):
    """Refuses calls without the mesh token with UNAUTHENTICATED (health and reflection stay open)."""

    def __init__(self, token: str) -> None:
        self._token = token.encode()

        def refuse(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "not a mesh peer: missing or wrong mesh token")

        self._refuse_unary = grpc.unary_unary_rpc_method_handler(refuse)
        self._refuse_stream = grpc.unary_stream_rpc_method_handler(refuse)

    def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        if method.startswith(_OPEN_METHODS):
            return continuation(handler_call_details)
        sent = dict(handler_call_details.invocation_metadata or ()).get(MESH_TOKEN_KEY, "")
        if hmac.compare_digest(sent.encode() if isinstance(sent, str) else sent, self._token):
            return continuation(handler_call_details)
        handler = continuation(handler_call_details)
        if handler is None:
            return None  # no such method: UNIMPLEMENTED
        return self._refuse_stream if handler.response_streaming else self._refuse_unary

"""Mesh credentials on every internal port (a worker's Prefill/Decode/WorkerInfo port, its KV
transfer and KV store port): a shared mesh token in call metadata, checked by a server interceptor
(a sync one on the KV ports, an asyncio one on the worker's API port), and mutual TLS when the
workers have certificates (the worker's certificate serves its KV port and is its client
certificate when it dials another's). Transfer ids are per-transfer capabilities on top."""

from __future__ import annotations

import hmac
from collections import namedtuple
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


def _carries(handler_call_details, token: bytes) -> bool:
    """Whether a call is a probe (health, reflection) or carries the mesh token."""
    if handler_call_details.method.startswith(_OPEN_METHODS):
        return True
    sent = dict(handler_call_details.invocation_metadata or ()).get(MESH_TOKEN_KEY, "")
    return hmac.compare_digest(sent.encode() if isinstance(sent, str) else sent, token)


class MeshTokenInterceptor(grpc.ServerInterceptor):
    """Refuses calls without the mesh token with UNAUTHENTICATED (health and reflection stay open)."""

    def __init__(self, token: str) -> None:
        self._token = token.encode()

        def refuse(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "not a mesh peer: missing or wrong mesh token")

        self._refuse_unary = grpc.unary_unary_rpc_method_handler(refuse)
        self._refuse_stream = grpc.unary_stream_rpc_method_handler(refuse)

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or _carries(handler_call_details, self._token):
            return handler  # None: no such method, UNIMPLEMENTED
        return self._refuse_stream if handler.response_streaming else self._refuse_unary


class AioMeshTokenInterceptor(grpc.aio.ServerInterceptor):
    """MeshTokenInterceptor for grpc.aio servers (a worker's Prefill/Decode/WorkerInfo port)."""

    def __init__(self, token: str) -> None:
        self._token = token.encode()

        async def refuse(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "not a mesh peer: missing or wrong mesh token")

        async def refuse_stream(request, context):   # a generator, as the tracing interceptor iterates it
            await refuse(request, context)
            yield

        self._refuse_unary = grpc.unary_unary_rpc_method_handler(refuse)
        self._refuse_stream = grpc.unary_stream_rpc_method_handler(refuse_stream)
        self._refuse_streams = grpc.stream_stream_rpc_method_handler(refuse_stream)   # DecodeStreams

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or _carries(handler_call_details, self._token):
            return handler
        if handler.request_streaming:
            return self._refuse_streams
        return self._refuse_stream if handler.response_streaming else self._refuse_unary


class _TokenMetadata:
    def __init__(self, token: str) -> None:
        self._pair = (MESH_TOKEN_KEY, token)

    def _details(self, details):
        return details._replace(metadata=grpc.aio.Metadata(*(details.metadata or ()), self._pair))


class _UnaryTokenMetadata(_TokenMetadata, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details), request)


class _StreamTokenMetadata(_TokenMetadata, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details), request)


class _StreamsTokenMetadata(_TokenMetadata, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return await continuation(self._details(client_call_details), request_iterator)


def token_interceptors(token: str) -> list[grpc.aio.ClientInterceptor]:
    """Add the mesh token to every call of a grpc.aio channel (the gateway's to its workers): one per
    kind of call (a channel files an interceptor under the first kind it implements)."""
    return [_UnaryTokenMetadata(token), _StreamTokenMetadata(token), _StreamsTokenMetadata(token)]


class _SyncMeshTokenMetadata(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    def __init__(self, token: str) -> None:
        self._pair = (MESH_TOKEN_KEY, token)

    def _details(self, details):
        return _CallDetails(details.method, details.timeout, (*(details.metadata or ()), self._pair),
                            details.credentials, details.wait_for_ready, details.compression)

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)


class _CallDetails(namedtuple("_CallDetails", ("method", "timeout", "metadata", "credentials", "wait_for_ready",
                                               "compression")), grpc.ClientCallDetails):
    pass


def with_mesh_token(channel: grpc.Channel, token: str) -> grpc.Channel:
    """A sync channel whose every call carries the mesh token (tools and tests calling a worker)."""
    return grpc.intercept_channel(channel, _SyncMeshTokenMetadata(token))

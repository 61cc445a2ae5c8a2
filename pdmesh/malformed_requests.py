"""Server interceptors that answer a request whose bytes are not a valid message of the method's
type with INVALID_ARGUMENT (gRPC's own answer is UNKNOWN naming a Python exception on grpc.aio,
INTERNAL on a synchronous server), for every method with a single request message."""

from __future__ import annotations

import inspect

import grpc
from google.protobuf.message import DecodeError


class _Malformed:
    def __init__(self, error: Exception) -> None:
        self.error = error


class RejectMalformedRequests(grpc.aio.ServerInterceptor):
    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None or handler.request_streaming:
            return handler
        method = handler_call_details.method
        parse = handler.request_deserializer
        if handler.response_streaming:
            return handler._replace(request_deserializer=_tolerant(parse),
                                    unary_stream=_checked_stream(handler.unary_stream, method))
        return handler._replace(request_deserializer=_tolerant(parse),
                                unary_unary=_checked_unary(handler.unary_unary, method))


class RejectMalformedRequestsSync(grpc.ServerInterceptor):
    """The same for a synchronous grpc.server (the KV transfer and store ports)."""

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None or handler.request_streaming:
            return handler
        kind = "unary_stream" if handler.response_streaming else "unary_unary"
        checked = _checked_sync(getattr(handler, kind), handler_call_details.method)
        return handler._replace(request_deserializer=_tolerant(handler.request_deserializer), **{kind: checked})


def _tolerant(parse):
    def deserialize(data: bytes):
        try:
            return parse(data)
        except (DecodeError, ValueError) as exc:
            return _Malformed(exc)
    return deserialize


def _checked_sync(behaviour, method: str):
    def call(request, context):
        if isinstance(request, _Malformed):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, _message(method, request))
        return behaviour(request, context)
    return call


def _message(method: str, request: _Malformed) -> str:
    return f"malformed request to {method}: {request.error}"


async def _abort(context: grpc.aio.ServicerContext, method: str, request: _Malformed) -> None:
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _message(method, request))


def _checked_unary(behaviour, method: str):
    async def call(request, context):
        if isinstance(request, _Malformed):
            await _abort(context, method, request)
        return await behaviour(request, context)
    return call


def _checked_stream(behaviour, method: str):
    if inspect.isasyncgenfunction(behaviour):
        async def stream(request, context):
            if isinstance(request, _Malformed):
                await _abort(context, method, request)
            async for response in behaviour(request, context):
                yield response
        return stream

    async def written(request, context):   # a handler that writes through the context
        if isinstance(request, _Malformed):
            await _abort(context, method, request)
        return await behaviour(request, context)
    return written

"""Applies the status table to grpc.aio handlers: domain errors become their status code,
anything unexpected becomes INTERNAL; the process keeps serving either way."""

from __future__ import annotations

import functools
import inspect
import logging

import grpc

from pdmesh.errors import PDMeshError
from pdmesh.status_map import error_from_grpc, grpc_status_of

logger = logging.getLogger(__name__)


def _status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, grpc.aio.AioRpcError):  # a peer's failure: keep its meaning
        return grpc_status_of(error_from_grpc(exc.code(), exc.details() or "")), exc.details() or str(exc)
    if isinstance(exc, PDMeshError):
        return grpc_status_of(exc), str(exc)
    logger.exception("unexpected error in handler")
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"


def maps_domain_errors(handler):
    """Decorator for unary and server-streaming grpc.aio servicer methods."""
    if inspect.isasyncgenfunction(handler):
        @functools.wraps(handler)
        async def stream_wrapper(self, request, context):
            try:
                async for item in handler(self, request, context):
                    yield item
            except (PDMeshError, grpc.aio.AioRpcError, ValueError, RuntimeError, OSError) as exc:
                await context.abort(*_status_of(exc))
        return stream_wrapper

    @functools.wraps(handler)
    async def unary_wrapper(self, request, context):
        try:
            return await handler(self, request, context)
        except (PDMeshError, grpc.aio.AioRpcError, ValueError, RuntimeError, OSError) as exc:
            await context.abort(*_status_of(exc))
    return unary_wrapper

"""Applies the status table to grpc.aio handlers: domain errors become their status code,
anything unexpected becomes INTERNAL; the process keeps serving either way."""

from __future__ import annotations

import functools
import inspect
import logging

import grpc

from pdmesh.errors import InternalError, PDMeshError
from pdmesh.status_map import error_from_rpc_error, error_metadata, grpc_status_of

logger = logging.getLogger(__name__)


def abort_args(exc: BaseException) -> tuple[grpc.StatusCode, str, tuple]:
    if isinstance(exc, grpc.aio.AioRpcError):  # a peer's failure: keep its meaning
        exc = error_from_rpc_error(exc)
    if isinstance(exc, PDMeshError):
        return grpc_status_of(exc), str(exc), error_metadata(exc)
    logger.exception("unexpected error in handler")
    internal = InternalError(f"internal error: {type(exc).__name__}: {exc}")
    return grpc_status_of(internal), str(internal), error_metadata(internal)


def maps_domain_errors(handler):
    """Decorator for unary and server-streaming grpc.aio servicer methods."""
    if inspect.isasyncgenfunction(handler):
        @functools.wraps(handler)
        async def stream_wrapper(self, request, context):
            try:
                async for item in handler(self, request, context):
                    yield item
            except Exception as exc:  # noqa: BLE001 - every failure becomes a status, never a crash
                await context.abort(*abort_args(exc))
        return stream_wrapper

    @functools.wraps(handler)
    async def unary_wrapper(self, request, context):
        try:
            return await handler(self, request, context)
        except Exception as exc:  # noqa: BLE001 - every failure becomes a status, never a crash
            await context.abort(*abort_args(exc))
    return unary_wrapper

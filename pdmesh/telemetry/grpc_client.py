"""Client-side gRPC tracing without interceptors, for the gateway's calls.

Any client interceptor puts every call of its channel behind grpc.aio's intercepted-call wrappers
(an extra task per call, an extra async hop per streamed message), and OpenTelemetry's unary one
also awaits the whole call inside itself, so cancelling the caller did not reach the server. The
gateway's channels have no interceptors: each call site opens a CLIENT span with `client_span` and
sends the span's context (W3C traceparent + baggage) as the call's metadata. Cancellation is
plain grpc.aio's; the span ends when the call's block does.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from opentelemetry import propagate, trace

from pdmesh.telemetry.tracing import tracer


@contextmanager
def client_span(method: str, tracer_: trace.Tracer | None = None) -> Iterator[tuple[tuple[str, str], ...]]:
    """A CLIENT span named like the RPC ("/package.Service/Method"), child of the current span;
    yields the metadata that carries its context to the server."""
    span = (tracer_ or tracer()).start_span(method, kind=trace.SpanKind.CLIENT, attributes={"rpc.system": "grpc"})
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=trace.set_span_in_context(span))
    try:
        yield tuple(carrier.items())
    except Exception as exc:
        span.record_exception(exc)
        span.set_status(trace.Status(trace.StatusCode.ERROR, str(exc)))
        raise
    finally:
        span.end()

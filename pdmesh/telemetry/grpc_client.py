"""Client-side gRPC tracing that keeps cancellation working.

OpenTelemetry's aio unary-unary interceptor awaits the whole call inside the interceptor, so
cancelling the caller cancels only the interceptor's await: the RPC itself runs on and the server
never hears of the cancel (a prefill the client abandoned still finished and pinned its KV). This
interceptor starts the client span, injects the trace context, and returns the call at once, so
`call.cancel()` and task cancellation reach the server; the span ends when the call does. The
streaming interceptors of OpenTelemetry do not have the problem and are kept.
"""

from __future__ import annotations

import grpc
from opentelemetry import propagate, trace
from opentelemetry.instrumentation.grpc import aio_client_interceptors

from pdmesh.telemetry.tracing import tracer


class CancellableUnaryUnaryTracing(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, tracer_provider: trace.TracerProvider | None = None) -> None:
        self._tracer = tracer_provider.get_tracer(__name__) if tracer_provider is not None else None

    async def intercept_unary_unary(self, continuation, client_call_details, request):
        method = client_call_details.method
        span = (self._tracer or tracer()).start_span(method.decode() if isinstance(method, bytes) else method,
                                   kind=trace.SpanKind.CLIENT, attributes={"rpc.system": "grpc"})
        carrier: dict[str, str] = {}
        propagate.inject(carrier, context=trace.set_span_in_context(span))
        metadata = grpc.aio.Metadata(*(client_call_details.metadata or ()), *carrier.items())
        try:
            call = await continuation(client_call_details._replace(metadata=metadata), request)
        except BaseException:
            span.end()
            raise
        call.add_done_callback(lambda _: span.end())
        return call


def client_interceptors() -> list:
    """OpenTelemetry's client interceptors, with the unary-unary one replaced by the cancellable one."""
    streaming = [i for i in aio_client_interceptors() if not isinstance(i, grpc.aio.UnaryUnaryClientInterceptor)]
    return [CancellableUnaryUnaryTracing(), *streaming]

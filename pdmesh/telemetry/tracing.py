"""OpenTelemetry tracing for every pdmesh process.

The request id travels as W3C baggage (`pdmesh.request_id`) next to the trace context, and a
span processor copies it onto every span a process starts, including the gRPC instrumentation's.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from opentelemetry import baggage, context, propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

from pdmesh.config import TelemetrySettings

REQUEST_ID_KEY = "pdmesh.request_id"
CLIENT_REQUEST_ID_KEY = "pdmesh.client_request_id"   # the id the client chose: a label, never acted on
TRACER_NAME = "pdmesh"


class OsRandomIdGenerator(IdGenerator):
    """Trace and span ids from os.urandom. The SDK's default draws from Python's global `random`,
    which vLLM seeds identically (seed=0) in every engine process: their span ids would collide."""

    def generate_span_id(self) -> int:
        return int.from_bytes(os.urandom(8), "big") or 1

    def generate_trace_id(self) -> int:
        return int.from_bytes(os.urandom(16), "big") or 1


class RequestIdSpanProcessor(SpanProcessor):
    """Stamps the request ids found in the parent context's baggage on each new span."""

    def on_start(self, span, parent_context=None) -> None:
        for key in (REQUEST_ID_KEY, CLIENT_REQUEST_ID_KEY):
            value = baggage.get_baggage(key, parent_context or context.get_current())
            if value:
                span.set_attribute(key, str(value))


def setup_tracing(settings: TelemetrySettings, service_name: str) -> TracerProvider | None:
    """Installs the global tracer provider; None (no-op tracing) when the exporter is "none"."""
    if settings.exporter == "none":
        return None
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}),
                              id_generator=OsRandomIdGenerator())
    provider.add_span_processor(RequestIdSpanProcessor())
    provider.add_span_processor(BatchSpanProcessor(_exporter(settings), schedule_delay_millis=settings.export_delay_ms))
    trace.set_tracer_provider(provider)
    return provider


def shutdown_tracing(provider: TracerProvider | None) -> None:
    if provider is not None:
        provider.shutdown()  # flushes queued spans


def tracer() -> trace.Tracer:
    return trace.get_tracer(TRACER_NAME)


@contextmanager
def request_context(request_id: str, client_request_id: str = "") -> Iterator[None]:
    """Makes request_id (the gateway's, which the workers act on) and the client's own id (a label
    to find a request's spans by) part of the baggage for everything started inside, and stamps
    the span already current (the gRPC server span, started before the request was read)."""
    ids = {REQUEST_ID_KEY: request_id, **({CLIENT_REQUEST_ID_KEY: client_request_id} if client_request_id else {})}
    trace.get_current_span().set_attributes(ids)
    carried = context.get_current()
    for key, value in ids.items():
        carried = baggage.set_baggage(key, value, carried)
    token = context.attach(carried)
    try:
        yield
    finally:
        context.detach(token)


def current_request_id() -> str:
    """The request id request_context put in the current context's baggage ("" outside one)."""
    return str(baggage.get_baggage(REQUEST_ID_KEY) or "")


def inject_carrier() -> dict[str, str]:
    """Trace context + baggage of the current context as a plain dict (to cross a non-gRPC hop)."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier


def extract_carrier(carrier: Mapping[str, str] | None) -> context.Context:
    return propagate.extract(dict(carrier or {}))


def _exporter(settings: TelemetrySettings):
    if settings.exporter == "console":
        return ConsoleSpanExporter()
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter(endpoint=settings.otlp_endpoint, insecure=True)

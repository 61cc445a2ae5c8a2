import json
import logging
import random

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pdmesh.telemetry.logs import JsonFormatter
from pdmesh.telemetry.tracing import (REQUEST_ID_KEY, OsRandomIdGenerator, RequestIdSpanProcessor, extract_carrier,
                                      inject_carrier, request_context)


def _provider():
    exporter = InMemorySpanExporter()
    provider = TracerProvider(id_generator=OsRandomIdGenerator())
    provider.add_span_processor(RequestIdSpanProcessor())
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


def test_request_id_lands_on_every_span_started_in_its_context():
    provider, exporter = _provider()
    tracer = provider.get_tracer("t")
    with tracer.start_as_current_span("outer"):
        with request_context("req-7"):
            with tracer.start_as_current_span("inner"):
                tracer.start_span("leaf").end()
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert {name: s.attributes.get(REQUEST_ID_KEY) for name, s in spans.items()} == \
        {"outer": "req-7", "inner": "req-7", "leaf": "req-7"}


def test_carrier_crosses_a_hop_with_trace_parent_and_request_id():
    provider, exporter = _provider()
    tracer = provider.get_tracer("t")
    with request_context("req-8"), tracer.start_as_current_span("decode") as decode:
        carrier = inject_carrier()
    assert set(carrier) == {"traceparent", "baggage"}
    tracer.start_span("kv.transfer", context=extract_carrier(carrier)).end()
    transfer = next(s for s in exporter.get_finished_spans() if s.name == "kv.transfer")
    assert transfer.parent.span_id == decode.get_span_context().span_id
    assert transfer.attributes[REQUEST_ID_KEY] == "req-8"


def test_span_ids_do_not_follow_pythons_seeded_random():
    random.seed(0)
    first = OsRandomIdGenerator().generate_span_id()
    random.seed(0)
    assert OsRandomIdGenerator().generate_span_id() != first


def test_json_log_line_carries_request_and_trace_ids():
    provider, _ = _provider()
    record = logging.LogRecord("pdmesh.x", logging.INFO, __file__, 1, "hello %s", ("world",), None)
    with request_context("req-9"), provider.get_tracer("t").start_as_current_span("s") as span:
        entry = json.loads(JsonFormatter().format(record))
    assert entry["message"] == "hello world" and entry["request_id"] == "req-9"
    assert entry["trace_id"] == format(span.get_span_context().trace_id, "032x")
    assert json.loads(JsonFormatter().format(record))["trace_id"] is None

"""The gateway's client spans: a cancelled caller cancels the server's handler, and the client
span's context reaches the server (real grpc.aio server and channel on loopback)."""

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pdmesh.telemetry.grpc_client import client_span

CHECK = "/grpc.health.v1.Health/Check"


class SlowHealth(health_pb2_grpc.HealthServicer):
    def __init__(self) -> None:
        self.events: list[str] = []
        self.traceparents: list[str] = []

    async def Check(self, request, context):
        self.traceparents += [v for k, v in context.invocation_metadata() if k == "traceparent"]
        try:
            await asyncio.sleep(float(request.service or 0))
        except asyncio.CancelledError:
            self.events.append("cancelled")
            raise
        self.events.append("finished")
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


@pytest.fixture
async def slow_server():
    servicer = SlowHealth()
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield servicer, f"127.0.0.1:{port}"
    await server.stop(0)


@pytest.fixture
def spans():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider.get_tracer("t"), exporter


async def test_cancelling_the_caller_cancels_the_rpc_on_the_server_and_ends_the_span(slow_server, spans):
    servicer, address = slow_server
    tracer, exporter = spans

    async def call(channel):
        with client_span(CHECK, tracer) as metadata:
            return await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="3"),
                                                                   metadata=metadata)

    async with grpc.aio.insecure_channel(address) as channel:
        task = asyncio.ensure_future(call(channel))
        await asyncio.sleep(0.3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(100):
            if servicer.events:
                break
            await asyncio.sleep(0.02)
    assert servicer.events == ["cancelled"]
    assert [s.name for s in exporter.get_finished_spans()] == [CHECK]


async def test_the_client_span_context_reaches_the_server_and_a_failure_marks_it(slow_server, spans):
    servicer, address = slow_server
    tracer, exporter = spans
    async with grpc.aio.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        with tracer.start_as_current_span("caller"), client_span(CHECK, tracer) as metadata:
            response = await stub.Check(health_pb2.HealthCheckRequest(service="0"), metadata=metadata)
        with pytest.raises(grpc.aio.AioRpcError), client_span(CHECK, tracer) as metadata:
            await stub.Check(health_pb2.HealthCheckRequest(service="5"), metadata=metadata, timeout=0.05)
    assert response.status == health_pb2.HealthCheckResponse.SERVING
    client, failed = [s for s in exporter.get_finished_spans() if s.name == CHECK]
    caller = next(s for s in exporter.get_finished_spans() if s.name == "caller")
    assert (client.kind, client.parent.span_id) == (trace.SpanKind.CLIENT, caller.context.span_id)
    _, trace_id, span_id, _ = servicer.traceparents[0].split("-")
    assert (int(trace_id, 16), int(span_id, 16)) == (client.context.trace_id, client.context.span_id)
    assert failed.status.status_code == trace.StatusCode.ERROR

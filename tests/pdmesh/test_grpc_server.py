"""AioServer: what grpcurl and load balancers see (reflection, health) and graceful stop."""

from __future__ import annotations

import asyncio

import grpc
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from pdmesh.grpc_server import AioServer
from pdmesh.v1 import generate_pb2

GENERATION = generate_pb2.DESCRIPTOR.services_by_name["Generation"].full_name


async def _reflect(address: str, request: reflection_pb2.ServerReflectionRequest):
    async with grpc.aio.insecure_channel(address) as channel:
        call = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(iter([request]))
        return [response async for response in call][0]


async def test_reflection_lists_the_services_and_describes_generate():
    server = AioServer([GENERATION])
    address = await server.start("127.0.0.1", 0)
    try:
        listed = await _reflect(address, reflection_pb2.ServerReflectionRequest(list_services=""))
        assert sorted(s.name for s in listed.list_services_response.service) == [
            "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection", "pdmesh.v1.Generation"]
        described = await _reflect(address, reflection_pb2.ServerReflectionRequest(
            file_containing_symbol=GENERATION))
        files = [descriptor_pb2.FileDescriptorProto.FromString(raw)
                 for raw in described.file_descriptor_response.file_descriptor_proto]
        methods = {m.name: (m.input_type, m.output_type, m.server_streaming)
                   for f in files for s in f.service if s.name == "Generation" for m in s.method}
        assert methods["Generate"] == (".pdmesh.v1.GenerateRequest", ".pdmesh.v1.GenerateResponse", True)
    finally:
        await server.stop(0)


async def test_health_is_serving_while_up_and_turns_not_serving_when_stop_begins():
    server = AioServer([GENERATION])
    address = await server.start("127.0.0.1", 0)
    async with grpc.aio.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        overall = await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        watch = health.Watch(health_pb2.HealthCheckRequest(service=GENERATION), timeout=10)
        first = await watch.read()
        stopping = asyncio.create_task(server.stop(grace_s=2))
        second = await watch.read()
        await stopping
    assert (overall.status, first.status, second.status) == (
        health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.SERVING,
        health_pb2.HealthCheckResponse.NOT_SERVING)

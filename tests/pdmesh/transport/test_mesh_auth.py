"""The mesh token on a grpc.aio worker port (the worker API: Prefill, Decode, WorkerInfo) and on the
gateway's channels to it: a real server and channel over loopback."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdmesh.config import TlsSettings
from pdmesh.grpc_server import AioServer
from pdmesh.tls import open_channel
from pdmesh.transport.mesh_auth import MESH_TOKEN_KEY, AioMeshTokenInterceptor
from pdmesh.v1 import worker_pb2, worker_pb2_grpc


class _Worker(worker_pb2_grpc.DecodeServicer, worker_pb2_grpc.WorkerInfoServicer):
    def __init__(self) -> None:
        self.seen_metadata: list[dict] = []

    async def Decode(self, request, context):
        for token_id in range(3):
            yield worker_pb2.DecodeResponse(token_ids=[token_id])

    async def DecodeStreams(self, request_iterator, context):
        async for message in request_iterator:
            yield worker_pb2.DecodeStreamsResponse(chunks=[worker_pb2.StreamChunk(
                stream_id=message.stream_id, response=worker_pb2.DecodeResponse(token_ids=[7]))])

    async def GetInfo(self, request, context):
        self.seen_metadata.append(dict(context.invocation_metadata()))
        return worker_pb2.WorkerInfoResponse(role="decode")


@pytest.fixture
async def served():
    worker = _Worker()
    server = AioServer(["pdmesh.v1.Decode", "pdmesh.v1.WorkerInfo"], interceptors=[AioMeshTokenInterceptor("s3")])
    worker_pb2_grpc.add_DecodeServicer_to_server(worker, server.server)
    worker_pb2_grpc.add_WorkerInfoServicer_to_server(worker, server.server)
    address = await server.start("127.0.0.1", 0)
    yield worker, address
    await server.stop(0)


async def _calls(address: str, token: str | None) -> tuple[object, object, object]:
    async with open_channel(address, TlsSettings(), mesh_token=token) as channel:
        results = []
        for call in (lambda: worker_pb2_grpc.WorkerInfoStub(channel).GetInfo(worker_pb2.GetInfoRequest(),
                                                                             metadata=(("traceparent", "t"),)),
                     lambda: _tokens(worker_pb2_grpc.DecodeStub(channel).Decode(worker_pb2.DecodeRequest())),
                     lambda: _first_of_streams(worker_pb2_grpc.DecodeStub(channel).DecodeStreams())):
            try:
                results.append(await call())
            except grpc.aio.AioRpcError as error:
                results.append(error.code())
        return tuple(results)


async def _first_of_streams(call) -> list[int]:
    """DecodeStreams (the gateway's shared call): one stream opened, the first message's tokens."""
    await call.write(worker_pb2.DecodeStreamsRequest(stream_id=1, open=worker_pb2.DecodeRequest()))
    message = await call.read()
    call.cancel()
    return [token_id for chunk in message.chunks for token_id in chunk.response.token_ids]


async def _tokens(call) -> list[int]:
    return [response.token_ids[0] async for response in call]


async def test_calls_with_the_token_are_served_and_keep_their_own_metadata(served):
    worker, address = served
    info, tokens, streamed = await _calls(address, "s3")
    assert (info.role, tokens, streamed) == ("decode", [0, 1, 2], [7])
    assert (worker.seen_metadata[0]["traceparent"], worker.seen_metadata[0][MESH_TOKEN_KEY]) == ("t", "s3")


@pytest.mark.parametrize("token", [None, "s4"])
async def test_calls_without_the_token_are_refused_unary_and_streamed(served, token):
    worker, address = served
    assert await _calls(address, token) == (grpc.StatusCode.UNAUTHENTICATED,) * 3
    assert worker.seen_metadata == []


async def test_health_needs_no_token(served):
    _, address = served
    async with open_channel(address, TlsSettings()) as channel:
        health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert health.status == health_pb2.HealthCheckResponse.SERVING

"""The worker's side of DecodeStreams (decode/decode_streams.py) over a real gRPC server on loopback,
with a stand-in engine that advances every stream one token a step (the real engine's path is the
mesh tests': the gateway decodes over this call by default)."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest

from decode.decode_streams import DecodeStreamsCall, batches
from pdmesh.errors import TransferNotFound
from pdmesh.grpc_server import AioServer
from pdmesh.status_map import status_code_of
from pdmesh.v1 import common_pb2, worker_pb2, worker_pb2_grpc


class SteppedEngine(worker_pb2_grpc.DecodeServicer):
    """Every open stream gets one token per step(); a prompt [n] asks for n tokens; a prompt [-1] fails
    with TransferNotFound; [0] waits for ever; [n, 0] makes n tokens and ends with no finish reason
    (vLLM's "error" or "repetition", which have none in pdmesh's enum)."""

    def __init__(self) -> None:
        self.step_done = asyncio.Condition()
        self.num_waiting = 0   # streams waiting for the next step
        self.cancelled: list[str] = []

    async def step(self) -> None:
        async with self.step_done:
            self.step_done.notify_all()

    async def DecodeStreams(self, request_iterator, context):
        async for message in DecodeStreamsCall(self._decode).serve(request_iterator):
            yield message

    async def _decode(self, request: worker_pb2.DecodeRequest):
        num_tokens = request.prompt_token_ids[0]
        if num_tokens < 0:
            raise TransferNotFound("no KV held for transfer 't'")
        try:
            for i in range(num_tokens or 10**9):
                async with self.step_done:
                    self.num_waiting += 1
                    try:
                        await self.step_done.wait()
                    finally:
                        self.num_waiting -= 1
                last = i == num_tokens - 1 and len(request.prompt_token_ids) == 1
                yield worker_pb2.DecodeResponse(token_ids=[i], finish_reason=common_pb2.FINISH_REASON_LENGTH
                                                if last else common_pb2.FINISH_REASON_UNSPECIFIED)
        except asyncio.CancelledError:
            self.cancelled.append(request.request_id)
            raise


@contextlib.asynccontextmanager
async def serving(engine: worker_pb2_grpc.DecodeServicer):
    """The engine's Decode service on a loopback port, and a channel to it; both closed after."""
    server = AioServer(["pdmesh.v1.Decode"])
    worker_pb2_grpc.add_DecodeServicer_to_server(engine, server.server)
    channel = grpc.aio.insecure_channel(await server.start("127.0.0.1", 0))
    try:
        yield channel, server
    finally:
        await channel.close()
        await server.stop(0)


@pytest.fixture
async def served():
    engine = SteppedEngine()
    async with serving(engine) as (channel, _):
        yield engine, worker_pb2_grpc.DecodeStub(channel)


def _open(stream_id: int, num_tokens: int, timeout_s: float = 0.0, finish: bool = True
          ) -> worker_pb2.DecodeStreamsRequest:
    prompt = [num_tokens] if finish else [num_tokens, 0]
    return worker_pb2.DecodeStreamsRequest(stream_id=stream_id, timeout_s=timeout_s, open=worker_pb2.DecodeRequest(
        request_id=f"r{stream_id}", prompt_token_ids=prompt))


async def _error_of(call) -> tuple[int, grpc.StatusCode, str, str]:
    """The next message's one chunk, an error: (stream id, code, domain error, message)."""
    (chunk,) = (await call.read()).chunks
    return chunk.stream_id, status_code_of(chunk.error.code), chunk.error.error, chunk.error.message


async def _until_open(engine: SteppedEngine, num_streams: int) -> None:
    while engine.num_waiting < num_streams:
        await asyncio.sleep(0.005)


async def test_a_steps_tokens_of_every_stream_travel_as_one_message(served):
    engine, stub = served
    call = stub.DecodeStreams()
    for stream_id in (1, 2, 3, 4):
        await call.write(_open(stream_id, 2))
    messages = []
    for _ in range(2):
        await _until_open(engine, 4)
        await engine.step()
        messages.append(await call.read())
    assert [sorted((c.stream_id, list(c.response.token_ids)) for c in m.chunks) for m in messages] == [
        [(1, [0]), (2, [0]), (3, [0]), (4, [0])], [(1, [1]), (2, [1]), (3, [1]), (4, [1])]]
    assert {c.response.finish_reason for c in messages[1].chunks} == {common_pb2.FINISH_REASON_LENGTH}
    await call.done_writing()
    assert await call.read() is grpc.aio.EOF   # every stream ended and the caller stopped writing
    assert await call.code() == grpc.StatusCode.OK


async def test_a_cancelled_stream_is_aborted_and_the_others_go_on(served):
    engine, stub = served
    call = stub.DecodeStreams()
    await call.write(_open(1, 3))
    await call.write(_open(2, 3))
    await _until_open(engine, 2)
    await call.write(worker_pb2.DecodeStreamsRequest(stream_id=1, cancel=True))
    while engine.cancelled != ["r1"]:
        await asyncio.sleep(0.005)
    await engine.step()
    message = await call.read()
    assert [(c.stream_id, list(c.response.token_ids)) for c in message.chunks] == [(2, [0])]
    call.cancel()


async def test_a_failed_stream_ends_with_its_error_and_the_others_go_on(served):
    engine, stub = served
    call = stub.DecodeStreams()
    await call.write(_open(1, 1))
    await _until_open(engine, 1)
    await call.write(_open(2, -1))
    assert await _error_of(call) == (2, grpc.StatusCode.NOT_FOUND, TransferNotFound.__name__,
                                     "no KV held for transfer 't'")
    await engine.step()
    assert [(c.stream_id, c.HasField("error")) for c in (await call.read()).chunks] == [(1, False)]
    call.cancel()


async def test_a_stream_past_its_deadline_ends_deadline_exceeded_and_is_aborted(served):
    engine, stub = served
    call = stub.DecodeStreams()
    await call.write(_open(1, 0, timeout_s=0.1))
    assert await _error_of(call) == (1, grpc.StatusCode.DEADLINE_EXCEEDED, "DeadlineExceeded",
                                     "stream 1 ran out of time")
    assert engine.cancelled == ["r1"]
    call.cancel()


async def test_a_stream_id_already_open_is_refused(served):
    engine, stub = served
    call = stub.DecodeStreams()
    await call.write(_open(1, 0))
    await _until_open(engine, 1)
    await call.write(_open(1, 0))
    assert await _error_of(call) == (1, grpc.StatusCode.INVALID_ARGUMENT, "InvalidRequest",
                                     "stream 1 is already open on this call")
    call.cancel()


async def test_the_call_ending_aborts_every_stream(served):
    engine, stub = served
    call = stub.DecodeStreams()
    await call.write(_open(1, 0))
    await call.write(_open(2, 0))
    await _until_open(engine, 2)
    call.cancel()
    while sorted(engine.cancelled) != ["r1", "r2"]:
        await asyncio.sleep(0.005)


async def test_a_stream_with_no_finish_reason_ends_with_an_end_chunk(served):
    engine, stub = served
    call = stub.DecodeStreams()
    await call.write(_open(1, 1, finish=False))
    await _until_open(engine, 1)
    await engine.step()
    chunks = []
    while not any(c.end for c in chunks):
        chunks += (await call.read()).chunks
    assert [(c.stream_id, list(c.response.token_ids), c.end) for c in chunks] == [(1, [0], False), (1, [], True)]
    call.cancel()


async def test_a_draining_call_refuses_new_streams_and_ends_with_its_last():
    engine = SteppedEngine()

    async def requests(opened: asyncio.Queue):
        while (message := await opened.get()) is not None:
            yield message
        await asyncio.Event().wait()   # the caller never stops writing

    opened: asyncio.Queue = asyncio.Queue()
    call = DecodeStreamsCall(engine._decode)
    answers = call.serve(requests(opened))
    first_answer = asyncio.ensure_future(anext(answers))   # the call runs while its answers are read
    opened.put_nowait(_open(1, 1))
    await _until_open(engine, 1)
    call.drain()
    opened.put_nowait(_open(2, 1))
    refused = (await first_answer).chunks[0]
    assert (refused.stream_id, refused.error.code, refused.error.error) == (
        2, grpc.StatusCode.UNAVAILABLE.value[0], "WorkerFailed")
    await engine.step()
    assert [(c.stream_id, c.response.finish_reason) for c in (await anext(answers)).chunks] == [
        (1, common_pb2.FINISH_REASON_LENGTH)]
    with pytest.raises(StopAsyncIteration):
        await anext(answers)


def test_a_big_batch_is_split_below_the_message_limit():
    text = "x" * 300_000
    chunks = [worker_pb2.StreamChunk(stream_id=n, response=worker_pb2.DecodeResponse(text=text)) for n in range(8)]
    messages = batches(chunks)
    assert [len(m.chunks) for m in messages] == [3, 3, 2]
    assert max(m.ByteSize() for m in messages) < 1 << 20 < sum(m.ByteSize() for m in messages)
    assert batches([]) == []

"""The gateway's side of a decode (gateway/decode_streams.py): many requests over one DecodeStreams
call to a real gRPC server on loopback (the worker's side is decode/decode_streams.py, driven by a
stand-in engine; tests/e2e decode over this call through real engines)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from gateway.decode_streams import DecodeStreams, StreamFailed, decode_call
from gateway.pool import Worker
from pdmesh.grpc_errors import maps_domain_errors
from pdmesh.v1 import worker_pb2
from tests.decode.test_decode_streams import SteppedEngine, serving


class CountingEngine(SteppedEngine):
    """SteppedEngine that also serves Decode (a call a request) and counts the calls made to it;
    `ignore_deadlines`: it drops the deadline each stream carries (only the gateway's own is left)."""

    def __init__(self) -> None:
        super().__init__()
        self.num_calls = 0
        self.ignore_deadlines = False

    async def DecodeStreams(self, request_iterator, context):
        self.num_calls += 1
        async for message in super().DecodeStreams(self._without_deadlines(request_iterator), context):
            yield message

    async def _without_deadlines(self, request_iterator):
        async for message in request_iterator:
            if self.ignore_deadlines:
                message.timeout_s = 0
            yield message

    @maps_domain_errors
    async def Decode(self, request, context):
        self.num_calls += 1
        async for chunk in self._decode(request):
            yield chunk


@pytest.fixture
async def worker():
    engine = CountingEngine()
    async with serving(engine) as (channel, server):
        yield engine, channel, server


def _request(request_id: str, num_tokens: int):
    return worker_pb2.DecodeRequest(request_id=request_id, prompt_token_ids=[num_tokens])


async def _collect(chunks) -> list[int] | grpc.StatusCode:
    try:
        return [token_id async for chunk in chunks for token_id in chunk.token_ids]
    except StreamFailed as failed:
        return failed.code


async def _stepping(engine: SteppedEngine, until: asyncio.Future) -> None:
    while not until.done():
        await engine.step()
        await asyncio.sleep(0.005)


async def _run(engine: SteppedEngine, *streams) -> list:
    gathered = asyncio.gather(*(_collect(s) for s in streams))
    await _stepping(engine, gathered)
    return await gathered


async def test_requests_share_one_call_and_each_gets_its_own_tokens(worker):
    engine, channel, _ = worker
    streams = DecodeStreams(channel)
    results = await _run(engine, *(streams.stream(_request(f"r{n}", n), 5.0, ()) for n in (1, 2, 3)))
    assert results == [[0], [0, 1], [0, 1, 2]]
    assert engine.num_calls == 1
    await streams.close()


async def test_one_call_a_request_gives_the_same(worker):
    engine, channel, _ = worker
    results = await _run(engine, *(decode_call(channel, _request(f"r{n}", n), 5.0, ()) for n in (1, 2, 3)))
    assert (results, engine.num_calls) == ([[0], [0, 1], [0, 1, 2]], 3)


async def test_a_reader_that_stops_early_aborts_its_decode(worker):
    engine, channel, _ = worker
    streams = DecodeStreams(channel)
    chunks = streams.stream(_request("r0", 0), 5.0, ())   # endless
    stepping = asyncio.ensure_future(_stepping(engine, asyncio.get_running_loop().create_future()))
    assert (await anext(chunks)).token_ids == [0]
    await chunks.aclose()
    await _until(lambda: engine.cancelled == ["r0"])
    stepping.cancel()
    await streams.close()


async def test_a_workers_error_reaches_its_stream_as_its_status(worker):
    engine, channel, _ = worker
    streams = DecodeStreams(channel)
    with pytest.raises(StreamFailed) as failed:
        await _collect_raising(streams.stream(_request("bad", -1), 5.0, ()))
    assert (failed.value.code, type(failed.value.error).__name__, failed.value.details) == (
        grpc.StatusCode.NOT_FOUND, "TransferNotFound", "no KV held for transfer 't'")
    await streams.close()


async def _collect_raising(chunks) -> None:
    async for _ in chunks:
        pass


async def test_a_stream_past_its_deadline_fails_deadline_exceeded(worker):
    engine, channel, _ = worker
    streams = DecodeStreams(channel)
    assert await _collect(streams.stream(_request("slow", 0), 0.1, ())) == grpc.StatusCode.DEADLINE_EXCEEDED
    await _until(lambda: engine.cancelled == ["slow"])   # by the worker's own deadline or the gateway's cancel
    await streams.close()


async def test_the_gateways_own_deadline_aborts_the_workers_decode(worker):
    engine, channel, _ = worker
    engine.ignore_deadlines = True
    streams = DecodeStreams(channel)
    assert await _collect(streams.stream(_request("slow", 0), 0.1, ())) == grpc.StatusCode.DEADLINE_EXCEEDED
    await _until(lambda: engine.cancelled == ["slow"])
    await streams.close()


async def test_a_stream_the_worker_ends_without_a_finish_reason_ends_there(worker):
    engine, channel, _ = worker
    streams = DecodeStreams(channel)
    unfinished = worker_pb2.DecodeRequest(request_id="r", prompt_token_ids=[2, 0])
    assert await _run(engine, streams.stream(unfinished, 5.0, ())) == [[0, 1]]
    assert engine.cancelled == []
    await streams.close()


async def test_one_streams_error_leaves_the_others_going(worker):
    engine, channel, _ = worker
    streams = DecodeStreams(channel)
    results = await _run(engine, streams.stream(_request("bad", -1), 5.0, ()), streams.stream(_request("ok", 3), 5.0, ()))
    assert results == [grpc.StatusCode.NOT_FOUND, [0, 1, 2]]
    await streams.close()


async def test_a_leaving_workers_close_waits_for_its_streams_within_the_grace(worker):
    engine, channel, _ = worker
    leaving = Worker("127.0.0.1:1", "decode", channel)
    decoding = asyncio.ensure_future(_collect(leaving.decode_streams().stream(_request("r", 3), 5.0, ())))
    await _until(lambda: engine.num_waiting == 1)
    closing = asyncio.ensure_future(leaving.close(grace_s=30.0))
    await _stepping(engine, decoding)
    assert await decoding == [0, 1, 2]
    async with asyncio.timeout(5):   # not the 30 s grace: its last stream ended
        await closing


async def test_a_call_torn_down_fails_every_stream_and_the_next_opens_another(worker):
    engine, channel, server = worker
    streams = DecodeStreams(channel)
    pending = [asyncio.ensure_future(_collect(streams.stream(_request(f"r{n}", 0), 5.0, ()))) for n in (1, 2)]
    await _until(lambda: engine.num_waiting == 2)
    await server.stop(0)
    assert await asyncio.gather(*pending) == [grpc.StatusCode.UNAVAILABLE] * 2
    assert await _collect(streams.stream(_request("r3", 1), 1.0, ())) == grpc.StatusCode.UNAVAILABLE
    await streams.close()


async def test_close_ends_the_call_and_its_tasks(worker):
    engine, channel, _ = worker
    streams = DecodeStreams(channel)
    pending = asyncio.ensure_future(_collect(streams.stream(_request("r0", 0), 5.0, ())))
    await _until(lambda: engine.num_waiting == 1)
    await streams.close()
    assert await pending == grpc.StatusCode.CANCELLED
    assert [t for t in asyncio.all_tasks() if t.get_coro().__qualname__.startswith("_Call.")] == []
    await _until(lambda: engine.cancelled == ["r0"])


async def _until(condition, timeout_s: float = 5.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.005)

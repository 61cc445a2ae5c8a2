"""The HTTP API's limits (issue 30, item 8), attacked through the real gateway (its OpenAI HTTP API on
127.0.0.1, port 0) in front of fake workers: slowloris connections, a body sent a byte at a time, more
connections than the cap, a 2-million-message chat body, a body of many messages just under the size limit,
a stop list of 100k strings. Where an attack could stall the event loop, a real stream runs beside it, and
its largest gap between two tokens is held to an idle run's."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import aiohttp
import grpc
import pytest

from gateway.server import Gateway
from pdmesh.client import generate, make_request
from pdmesh.config import GatewaySettings
from pdmesh.validation import MAX_STOP_CHARS, MAX_STOP_STRINGS
from tests.gateway.fake_workers import FakeWorker

TOKEN_INTERVAL_S = 0.02                  # the paced decode's time per token
STREAM_TOKENS = 64
STREAM_PROMPT = list(range(1, 1 + STREAM_TOKENS))   # the fake decode streams the prompt back: 64 + 64 = the context
GAP_SLACK_S = 0.3     # a stream's largest gap under attack may exceed its idle run's by this (a stall: seconds)
SLOWLORIS_CONNECTIONS = 200
SLOWLORIS_BYTE_EVERY_S = 0.2
Result = TypeVar("Result")
HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
HEALTH = b"GET /health HTTP/1.1\r\nHost: gateway\r\n\r\n"


class PacedDecode(FakeWorker):
    """A decode worker that streams one token every TOKEN_INTERVAL_S, as an engine does."""

    def __init__(self) -> None:
        super().__init__("decode")

    async def Decode(self, request, context):
        async for response in super().Decode(request, context):
            await asyncio.sleep(TOKEN_INTERVAL_S)
            yield response


@dataclass
class HttpMesh:
    gateway: Gateway
    grpc: str        # the gateway's gRPC API
    prefill: FakeWorker
    decode: FakeWorker

    @property
    def http(self) -> str:
        return self.gateway.http_address

    @property
    def host_port(self) -> tuple[str, int]:
        host, port = self.http.rsplit(":", 1)
        return host, int(port)


@pytest.fixture
async def mesh_of(tiny_llama_dir, no_thread_leak):
    """mesh_of(**gateway settings) -> a gateway serving HTTP in front of a fake prefill and a paced decode;
    all stopped after the test, no thread left running."""
    started: list[tuple[Gateway, FakeWorker, FakeWorker]] = []

    async def start(**settings) -> HttpMesh:
        prefill, decode = FakeWorker("prefill"), PacedDecode()
        workers = {"prefill_workers": [await prefill.server.start("127.0.0.1", 0)],
                   "decode_workers": [await decode.server.start("127.0.0.1", 0)]}
        gateway = Gateway(GatewaySettings(port=0, http_port=0, tokenizer=str(tiny_llama_dir), **workers, **settings))
        started.append((gateway, prefill, decode))
        return HttpMesh(gateway, await gateway.start(), prefill, decode)

    yield start
    for gateway, prefill, decode in started:
        await gateway.stop(0)
        await prefill.server.stop(0)
        await decode.server.stop(0)


async def _stream_gaps(address: str) -> list[float]:
    """Streams a completion of STREAM_TOKENS tokens over HTTP: the gaps (s) between its token events."""
    loop = asyncio.get_running_loop()
    body = {"prompt": STREAM_PROMPT, "max_tokens": STREAM_TOKENS, "stream": True}
    arrivals: list[float] = []
    async with aiohttp.ClientSession() as session, \
            session.post(f"http://{address}/v1/completions", json=body) as response:
        assert response.status == 200
        async for line in response.content:
            if line.startswith(b"data: {") and json.loads(line[6:])["choices"][0]["text"]:
                arrivals.append(loop.time())
    assert len(arrivals) == STREAM_TOKENS
    return [later - earlier for earlier, later in zip(arrivals, arrivals[1:])]


async def _post(address: str, path: str, body: bytes) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as session, \
            session.post(f"http://{address}{path}", data=body,
                         headers={"Content-Type": "application/json"}) as response:
        return response.status, await response.json()


async def _beside_a_stream(mesh: HttpMesh, attack: Callable[[], Awaitable[Result]],
                           tries: int = 2) -> tuple[list[Result], float, float]:
    """Mounts `attack()` `tries` times, each beside a stream: (the attack's results, the smaller of those
    streams' largest gaps, an idle stream's largest gap). The smaller: a busy test machine can stall any one
    stream for a moment; what the attack stalls, it stalls every time."""
    idle = max(await _stream_gaps(mesh.http))
    results, gaps = [], []
    for _ in range(tries):
        stream = asyncio.ensure_future(_stream_gaps(mesh.http))
        await asyncio.sleep(10 * TOKEN_INTERVAL_S)   # the stream is under way
        results.append(await attack())
        gaps.append(max(await stream))
    return results, min(gaps), idle


async def _exchange(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes) -> tuple[int, bytes]:
    """Sends one request, reads one response: (status, body)."""
    writer.write(request)
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length"))
    return status, await reader.readexactly(length)


def _completion_request(max_tokens: int) -> bytes:
    body = json.dumps({"prompt": STREAM_PROMPT[:4], "max_tokens": max_tokens}).encode()
    return HEAD + f"Content-Length: {len(body)}\r\n\r\n".encode() + body


# ---- slowloris: request heads a byte at a time ----

async def _trickle_until_closed(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, data: bytes) -> bytes:
    """Sends `data` a byte every SLOWLORIS_BYTE_EVERY_S (then nothing) until the server closes the
    connection: what it answered meanwhile."""
    answer, unsent = b"", data
    while True:
        if unsent:
            writer.write(unsent[:1])
            unsent = unsent[1:]
        try:
            chunk = await asyncio.wait_for(reader.read(4096), SLOWLORIS_BYTE_EVERY_S)
        except TimeoutError:
            continue
        except ConnectionError:
            return answer
        if not chunk:
            return answer
        answer += chunk


async def _slowloris(host: str, port: int, give_up_s: float) -> float | None:
    """Sends a request head that never ends, a byte at a time: how long (s) until the server closed the
    connection, None if it still held it after `give_up_s`."""
    loop = asyncio.get_running_loop()
    opened = loop.time()   # before the connection opens: the server's clock for it starts later
    reader, writer = await asyncio.open_connection(host, port)
    try:
        await asyncio.wait_for(_trickle_until_closed(reader, writer, HEAD + b"X-Padding: " + b"a" * 10_000),
                               give_up_s)
        return loop.time() - opened
    except TimeoutError:
        return None
    finally:
        writer.close()


async def test_slowloris_connections_are_closed_at_the_header_timeout_and_a_stream_goes_on(mesh_of):
    """200 connections trickle request heads (more often than the timeout, so only a deadline on the whole
    head catches them): each is closed within the header timeout, while a stream's tokens keep their pace.
    Before: no deadline on a request head (aiohttp's keep-alive timer, 3630 s by default), the 200 sockets
    were held as long as the attacker liked."""
    mesh = await mesh_of(http_header_timeout_s=1.0)
    host, port = mesh.host_port

    async def attack() -> list[float | None]:
        return list(await asyncio.gather(*(_slowloris(host, port, give_up_s=6.0)
                                           for _ in range(SLOWLORIS_CONNECTIONS))))

    tries, gap, idle_gap = await _beside_a_stream(mesh, attack)
    for held_s in tries:
        assert None not in held_s, f"{held_s.count(None)} of {SLOWLORIS_CONNECTIONS} connections open after 6 s"
        assert 0.99 <= min(held_s) and max(held_s) < 4.0   # 1 s, and what a busy machine adds
    assert gap < idle_gap + GAP_SLACK_S, (gap, idle_gap)
    assert max(await _stream_gaps(mesh.http)) < idle_gap + GAP_SLACK_S   # served as before


@pytest.mark.parametrize("next_head", [b"", HEAD], ids=["idle", "trickling"])
async def test_a_keep_alive_connection_idle_or_trickling_its_next_head_is_closed_at_the_keep_alive_timeout(
        mesh_of, next_head):
    """After one request, the connection sends nothing, or the next head a byte at a time: closed at the
    keep-alive timeout either way. Before: aiohttp's default, 3630 s."""
    mesh = await mesh_of(http_keepalive_timeout_s=1.0)
    loop = asyncio.get_running_loop()
    reader, writer = await asyncio.open_connection(*mesh.host_port)
    try:
        assert await _exchange(reader, writer, HEALTH) == (200, b'{"status": "ok"}')
        answered = loop.time()
        assert await asyncio.wait_for(_trickle_until_closed(reader, writer, next_head), timeout=6.0) == b""
        held_s = loop.time() - answered
    finally:
        writer.close()
    assert 0.8 <= held_s < 4.0   # (the server's clock starts as it answers, a moment before ours)


async def test_a_body_sent_a_byte_at_a_time_is_408_at_the_body_timeout(mesh_of):
    """The head arrives whole, the body a byte every 0.1 s: 408 once the body timeout passes. Before: the
    handler waited for the body as long as the client kept sending."""
    mesh = await mesh_of(http_body_timeout_s=1.0)
    loop = asyncio.get_running_loop()
    reader, writer = await asyncio.open_connection(*mesh.host_port)
    try:
        writer.write(HEAD + b"Content-Length: 1000\r\n\r\n")
        sent = loop.time()
        answer = await asyncio.wait_for(_trickle_until_answered(reader, writer), timeout=4.0)
        waited_s = loop.time() - sent
    finally:
        writer.close()
    assert answer.startswith(b"HTTP/1.1 408 ")
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1]) == {"error": {
        "message": "the request body did not arrive within 1 s", "type": "HTTPRequestTimeout", "code": 408}}
    assert 1.0 <= waited_s < 3.0


async def _trickle_until_answered(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bytes:
    while True:
        writer.write(b" ")
        try:
            answer = await asyncio.wait_for(reader.read(4096), 0.1)
        except TimeoutError:
            continue
        while b"\r\n\r\n" in answer and not answer.endswith(b"}"):   # the whole (JSON) body
            answer += await reader.read(4096)
        return answer


# ---- the connection cap ----

async def test_connections_past_the_cap_are_answered_503_at_once_while_those_open_are_served(mesh_of):
    """4 connections open (the cap), idle: a 5th is answered 503 and closed at once; the 4 are then served;
    once one closes, a new connection is served. Before: no cap, the 5th was served like the others (and
    connections piled up until the process ran out of file descriptors)."""
    mesh = await mesh_of(http_max_connections=4)
    loop = asyncio.get_running_loop()
    holders = [await asyncio.open_connection(*mesh.host_port) for _ in range(4)]
    try:
        reader, writer = await asyncio.open_connection(*mesh.host_port)
        asked = loop.time()
        writer.write(HEALTH)
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=2.0)
        assert head.startswith(b"HTTP/1.1 503 Service Unavailable\r\n") and b"Connection: close" in head
        body = await asyncio.wait_for(reader.read(), timeout=2.0)   # up to the server's close
        refused_in_s = loop.time() - asked
        writer.close()
        assert json.loads(body) == {"error": {"message": "the gateway has 4 connections open (its limit); retry later",
                                              "type": "HTTPServiceUnavailable", "code": 503}}
        assert refused_in_s < 1.0
        for holder_reader, holder_writer in holders:
            assert await _exchange(holder_reader, holder_writer, HEALTH) == (200, b'{"status": "ok"}')
        status, body = await _exchange(*holders[0], _completion_request(max_tokens=3))
        assert (status, json.loads(body)["choices"][0]["text"]) == (200, "<1><2><3>")
        holders.pop()[1].close()
        assert await _served_within(mesh, timeout_s=2.0)
    finally:
        for _, holder_writer in holders:
            holder_writer.close()


async def _served_within(mesh: HttpMesh, timeout_s: float) -> bool:
    """Whether a new connection gets /health 200 within `timeout_s` (a closed one's slot frees soon after)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while asyncio.get_running_loop().time() < deadline:
        reader, writer = await asyncio.open_connection(*mesh.host_port)
        try:
            if (await _exchange(reader, writer, HEALTH))[0] == 200:
                return True
        finally:
            writer.close()
        await asyncio.sleep(0.05)
    return False


# ---- big bodies ----

async def test_a_two_million_message_chat_body_is_413_unread_and_a_stream_goes_on(mesh_of):
    """32 MB of chat messages, over the 4 MiB default: 413 from its declared length, at once, none of it
    parsed; a stream beside it keeps its pace. Before: the limit was 64 MiB and the body was parsed,
    validated and rendered on the event loop, every stream stalled for seconds."""
    mesh = await mesh_of()
    body = b'{"messages":[' + b",".join([b'{"role":"user"}'] * 2_000_000) + b"]}"
    loop = asyncio.get_running_loop()

    async def attack() -> tuple[int, dict, float]:
        sent = loop.time()
        status, answer = await asyncio.wait_for(_post(mesh.http, "/v1/chat/completions", body), timeout=60.0)
        return status, answer, loop.time() - sent

    tries, gap, idle_gap = await _beside_a_stream(mesh, attack)
    for status, answer, answered_in_s in tries:
        assert (status, answer) == (413, {"error": {
            "message": f"Maximum request body size {4 * 1024 * 1024} exceeded.", "type": "HTTPRequestEntityTooLarge",
            "code": 413}})
        assert answered_in_s < 3.0
    assert len(body) > 30_000_000
    assert gap < idle_gap + GAP_SLACK_S, (gap, idle_gap)


async def test_a_body_of_many_messages_under_the_limit_is_parsed_off_the_event_loop(mesh_of):
    """~140k messages in just under 4 MiB (the default limit): parsed, validated and rendered in a worker
    thread, then refused (far longer than the context) while a stream beside it keeps its pace. Before:
    all of it ran on the event loop (~1 s here), and the stream stalled that long."""
    mesh = await mesh_of()
    message = b'{"role":"user","content":"x"}'
    body = b'{"messages":[' + b",".join([message] * ((4 * 1024 * 1024 - 100) // (len(message) + 1))) + b"]}"

    async def attack() -> tuple[int, dict]:
        return await asyncio.wait_for(_post(mesh.http, "/v1/chat/completions", body), timeout=60.0)

    tries, gap, idle_gap = await _beside_a_stream(mesh, attack)
    for status, answer in tries:
        assert (status, answer["error"]["type"]) == (400, "InvalidRequest")
        assert "is longer than the model's context of 128 tokens can hold" in answer["error"]["message"]
    assert len(body) <= 4 * 1024 * 1024
    assert gap < idle_gap + GAP_SLACK_S, (gap, idle_gap)


# ---- stop strings ----

@pytest.mark.parametrize("stop, message", [
    ([f"s{i}" for i in range(100_000)], f"stop has 100000 strings; at most {MAX_STOP_STRINGS} are allowed"),
    (["x" * (MAX_STOP_CHARS + 1)], f"a stop string has {MAX_STOP_CHARS + 1} characters; at most {MAX_STOP_CHARS} "
                                   "are allowed"),
])
async def test_a_stop_list_past_the_limits_is_400_over_http_and_invalid_argument_over_grpc(mesh_of, stop, message):
    """Before: any number of stop strings, of any length, went to the engines (each is searched for in every
    new piece of text)."""
    mesh = await mesh_of()
    body = json.dumps({"prompt": STREAM_PROMPT[:4], "max_tokens": 2, "stop": stop}).encode()
    assert await _post(mesh.http, "/v1/completions", body) == (400, {"error": {
        "message": message, "type": "InvalidRequest", "code": 400}})
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await generate(mesh.grpc, make_request(STREAM_PROMPT[:4], max_tokens=2, stop=stop))
    assert (refused.value.code(), refused.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT, message)
    assert mesh.prefill.requests == [] and mesh.decode.requests == []


async def test_a_stop_list_at_the_limits_is_served(mesh_of):
    mesh = await mesh_of()
    stop = [f"{i:04d}" + "x" * (MAX_STOP_CHARS - 4) for i in range(MAX_STOP_STRINGS)]
    body = json.dumps({"prompt": STREAM_PROMPT[:4], "max_tokens": 2, "stop": stop}).encode()
    status, answer = await _post(mesh.http, "/v1/completions", body)
    assert (status, answer["choices"][0]["text"]) == (200, "<1><2>")
    assert list(mesh.decode.requests[0].sampling.stop) == stop

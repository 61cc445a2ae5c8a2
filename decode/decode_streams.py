"""The worker's side of DecodeStreams: many decodes over one call, what every stream produced in an
engine step sent as one message (gateway/decode_streams.py is the gateway's side).

gRPC's per-message cost (tens of microseconds of CPU on each side) is paid once per engine step
instead of once per stream and step: the engine's output handler hands a step's outputs to every
stream at once, each stream's task appends its chunk, and the writer, woken after them, sends the
lot (split to stay far below the message size limit). A stream ends with its finish reason, an
error chunk carrying what Decode's status would (the others go on), or an `end` chunk; the caller's
cancel aborts one stream; the call ending aborts them all. Draining (the worker stopping), new
streams are refused UNAVAILABLE and the call ends once its streams have.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from opentelemetry import context as otel_context
from opentelemetry import propagate

from pdmesh.errors import DeadlineExceeded, InvalidRequest, WorkerFailed
from pdmesh.grpc_errors import abort_args
from pdmesh.v1 import worker_pb2

Decode = Callable[[worker_pb2.DecodeRequest], AsyncIterator[worker_pb2.DecodeResponse]]
MAX_MESSAGE_BYTES = 1 << 20   # a batch is split past this (the channels' limit is 5 MiB)


def error_chunk(stream_id: int, exc: BaseException) -> worker_pb2.StreamChunk:
    """The chunk that ends a failed stream: Decode's status and domain error, as values."""
    code, message, metadata = abort_args(exc)
    names = [value for _, value in metadata]
    return worker_pb2.StreamChunk(stream_id=stream_id, error=worker_pb2.StreamError(
        code=code.value[0], message=message, error=names[0] if names else ""))


def batches(chunks: list[worker_pb2.StreamChunk]) -> list[worker_pb2.DecodeStreamsResponse]:
    """The chunks as messages of at most about MAX_MESSAGE_BYTES each (one, almost always)."""
    messages, batch, num_bytes = [], [], 0
    for chunk in chunks:
        size = chunk.ByteSize()
        if batch and num_bytes + size > MAX_MESSAGE_BYTES:
            messages.append(worker_pb2.DecodeStreamsResponse(chunks=batch))
            batch, num_bytes = [], 0
        batch.append(chunk)
        num_bytes += size
    return [*messages, worker_pb2.DecodeStreamsResponse(chunks=batch)] if batch else messages


class DecodeStreamsCall:
    """One DecodeStreams call: its streams, and the chunks they produced not yet sent."""

    def __init__(self, decode: Decode) -> None:
        self._decode = decode
        self._streams: dict[int, asyncio.Task] = {}
        self._outbox: list[worker_pb2.StreamChunk] = []
        self._wake = asyncio.Event()
        self._draining = False

    def drain(self) -> None:
        """Refuse new streams; end the call once the open ones have ended."""
        self._draining = True
        self._wake.set()

    async def serve(self, requests: AsyncIterator[worker_pb2.DecodeStreamsRequest]
                    ) -> AsyncIterator[worker_pb2.DecodeStreamsResponse]:
        """The call's answer: batches of chunks until every stream ended and the caller stopped writing
        (or the worker is draining)."""
        reader = asyncio.ensure_future(self._read(requests))
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                chunks, self._outbox = self._outbox, []
                for message in batches(chunks):
                    yield message
                if (reader.done() or self._draining) and not self._streams and not self._outbox:
                    if reader.done():
                        reader.result()
                    return
        finally:
            reader.cancel()
            for task in self._streams.values():
                task.cancel()   # the engine aborts each request and frees its blocks

    async def _read(self, requests: AsyncIterator[worker_pb2.DecodeStreamsRequest]) -> None:
        try:
            async for message in requests:
                if message.HasField("open"):
                    self._open(message)
                elif message.cancel and message.stream_id in self._streams:
                    self._streams[message.stream_id].cancel()
        finally:
            self._wake.set()

    def _open(self, message: worker_pb2.DecodeStreamsRequest) -> None:
        stream_id = message.stream_id
        if self._draining:
            self._send(error_chunk(stream_id, WorkerFailed("the worker is stopping")))
        elif stream_id in self._streams:
            self._send(error_chunk(stream_id, InvalidRequest(f"stream {stream_id} is already open on this call")))
        else:
            self._streams[stream_id] = asyncio.ensure_future(self._run(message))

    async def _run(self, message: worker_pb2.DecodeStreamsRequest) -> None:
        stream_id = message.stream_id
        otel_context.attach(propagate.extract(dict(message.trace_context)))   # this task's own context
        finished, deadline = False, None
        try:
            async with asyncio.timeout(message.timeout_s or None) as deadline:
                async for response in self._decode(message.open):
                    finished = response.finish_reason != 0
                    self._send(worker_pb2.StreamChunk(stream_id=stream_id, response=response))
            if not finished:
                self._send(worker_pb2.StreamChunk(stream_id=stream_id, end=True))
        except asyncio.CancelledError:
            pass   # the caller cancelled it, or the call ended: no one reads an answer
        except Exception as exc:  # noqa: BLE001 - a stream's failure is its chunk, never the call's
            if isinstance(exc, TimeoutError) and deadline is not None and deadline.expired():
                exc = DeadlineExceeded(f"stream {stream_id} ran out of time")
            self._send(error_chunk(stream_id, exc))
        finally:
            del self._streams[stream_id]
            self._wake.set()

    def _send(self, chunk: worker_pb2.StreamChunk) -> None:
        self._outbox.append(chunk)
        self._wake.set()

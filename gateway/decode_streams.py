"""The gateway's side of a decode: one DecodeStreams call per worker carries every request this
gateway decodes there (decode/decode_streams.py is the worker's side), or one Decode call a request.

gRPC's per-message cost on each side (≈ 80 µs of CPU a message, both ends together, measured on this
machine) is the mesh's largest per-token cost; over one call a worker sends each engine step's tokens
of all its streams as one message. Both ways yield the worker's DecodeResponse messages and raise
StreamFailed with the status the worker (or the transport) gave: the caller maps it as it would any
call's failure. Writes go through one task (a call takes one write at a time), so opening and
cancelling a stream never wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator, Sequence

import grpc

from pdmesh.errors import PDMeshError
from pdmesh.status_map import error_from_rpc_error, error_named, status_code_of
from pdmesh.v1 import worker_pb2, worker_pb2_grpc


class StreamFailed(Exception):
    """A decode's failure: the status code it came with and the domain error it stands for."""

    def __init__(self, code: grpc.StatusCode, error: PDMeshError) -> None:
        super().__init__(f"{code.name}: {error}")
        self.code = code
        self.error = error

    @property
    def details(self) -> str:
        return str(self.error)

    @classmethod
    def of_status(cls, code: grpc.StatusCode, details: str) -> StreamFailed:
        return cls(code, error_named(code, details))

    @classmethod
    def of_rpc_error(cls, exc: grpc.aio.AioRpcError) -> StreamFailed:
        return cls(exc.code(), error_from_rpc_error(exc))

    @classmethod
    def of_chunk(cls, error: worker_pb2.StreamError) -> StreamFailed:
        code = status_code_of(error.code)
        return cls(code, error_named(code, error.message, error.error))


END = object()   # in a stream's inbox: the worker ended it with no finish reason


async def decode_call(channel: grpc.aio.Channel, request: worker_pb2.DecodeRequest, timeout_s: float,
                      metadata: Sequence[tuple[str, str]]) -> AsyncIterator[worker_pb2.DecodeResponse]:
    """One Decode call for one request."""
    call = worker_pb2_grpc.DecodeStub(channel).Decode(request, timeout=timeout_s, metadata=tuple(metadata))
    try:
        async for chunk in call:
            yield chunk
    except grpc.aio.AioRpcError as exc:
        raise StreamFailed.of_rpc_error(exc) from exc
    finally:
        call.cancel()  # the client went away: decode aborts and frees its blocks


class DecodeStreams:
    """The DecodeStreams call to one worker, opened by its first stream and again after it failed."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self._channel = channel
        self._call: _Call | None = None
        self._stream_ids = itertools.count(1)

    async def stream(self, request: worker_pb2.DecodeRequest, timeout_s: float,
                     metadata: Sequence[tuple[str, str]]) -> AsyncIterator[worker_pb2.DecodeResponse]:
        """One request's decode: the worker's messages until the one with a finish reason."""
        if self._call is None or self._call.ended:
            self._call = _Call(worker_pb2_grpc.DecodeStub(self._channel).DecodeStreams())
        call, stream_id = self._call, next(self._stream_ids)
        inbox = call.open(stream_id, worker_pb2.DecodeStreamsRequest(
            stream_id=stream_id, open=request, timeout_s=timeout_s, trace_context=dict(metadata)))
        expired = StreamFailed.of_status(grpc.StatusCode.DEADLINE_EXCEEDED,
                                         f"request {request.request_id} ran out of time")
        deadline = asyncio.get_running_loop().call_later(timeout_s, inbox.put_nowait, expired)
        ended = False   # by the worker: its decode is over (a finish reason, an error, the end)
        try:
            while not ended:
                chunk = await inbox.get()
                if isinstance(chunk, StreamFailed):
                    ended = chunk is not expired
                    raise chunk
                if chunk is END:
                    ended = True
                    return
                ended = chunk.finish_reason != 0
                yield chunk
        finally:
            deadline.cancel()
            call.close_stream(stream_id, cancel=not ended)

    async def wait_idle(self, timeout_s: float) -> None:
        """Until no stream is open on the call (the worker is leaving: its decodes may finish), at most
        timeout_s."""
        if self._call is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._call.idle.wait(), timeout_s)

    async def close(self) -> None:
        if self._call is not None:
            await self._call.close()


class _Call:
    """One DecodeStreams call: its open streams' inboxes, a reader routing the worker's chunks to
    them, and a writer sending what the streams ask."""

    def __init__(self, call: grpc.aio.StreamStreamCall) -> None:
        self._call = call
        self._inboxes: dict[int, asyncio.Queue] = {}
        self._outbox: asyncio.Queue[worker_pb2.DecodeStreamsRequest] = asyncio.Queue()
        self._writer = asyncio.ensure_future(self._write())
        self._reader = asyncio.ensure_future(self._read())
        self._failure: StreamFailed | None = None   # set once the call ended: every stream's end
        self.idle = asyncio.Event()   # set while no stream is open
        self._write_failure: StreamFailed | None = None   # why writing failed, if it did

    @property
    def ended(self) -> bool:
        return self._failure is not None

    def open(self, stream_id: int, message: worker_pb2.DecodeStreamsRequest) -> asyncio.Queue:
        inbox: asyncio.Queue = asyncio.Queue()
        if self._failure is not None:
            inbox.put_nowait(self._failure)
            return inbox
        self._inboxes[stream_id] = inbox
        self.idle.clear()
        self._outbox.put_nowait(message)
        return inbox

    def close_stream(self, stream_id: int, cancel: bool) -> None:
        """The stream's reader is done with it; `cancel`: the worker aborts its decode."""
        self._inboxes.pop(stream_id, None)
        if not self._inboxes:
            self.idle.set()
        if cancel and not self.ended:
            self._outbox.put_nowait(worker_pb2.DecodeStreamsRequest(stream_id=stream_id, cancel=True))

    async def close(self) -> None:
        self._call.cancel()
        for task in (self._writer, self._reader):
            task.cancel()
        await asyncio.gather(self._writer, self._reader, return_exceptions=True)

    async def _write(self) -> None:
        try:
            while True:
                await self._call.write(await self._outbox.get())
        except grpc.aio.AioRpcError as exc:   # the call failed: the reader tells every stream why
            self._write_failure = StreamFailed.of_rpc_error(exc)
            self._call.cancel()
        except Exception as exc:  # noqa: BLE001 - the call cannot go on
            self._write_failure = StreamFailed.of_status(grpc.StatusCode.UNAVAILABLE,
                                                         f"decode streams failed: {exc!r}")
            self._call.cancel()

    async def _read(self) -> None:
        failure = StreamFailed.of_status(grpc.StatusCode.UNAVAILABLE, "the worker ended its decode streams")
        try:
            while (message := await self._call.read()) is not grpc.aio.EOF:
                for chunk in message.chunks:
                    inbox = self._inboxes.get(chunk.stream_id)
                    if inbox is not None:
                        inbox.put_nowait(_item(chunk))
        except grpc.aio.AioRpcError as exc:
            failure = StreamFailed.of_rpc_error(exc)
        except asyncio.CancelledError:
            failure = self._write_failure or StreamFailed.of_status(grpc.StatusCode.CANCELLED,
                                                                    "the gateway closed its decode streams")
        except Exception as exc:  # noqa: BLE001 - whatever ended the call ends its streams
            failure = StreamFailed.of_status(grpc.StatusCode.UNAVAILABLE, f"decode streams failed: {exc!r}")
        finally:
            self._failure = failure
            self.idle.set()
            self._writer.cancel()
            for inbox in self._inboxes.values():
                inbox.put_nowait(failure)


def _item(chunk: worker_pb2.StreamChunk) -> worker_pb2.DecodeResponse | StreamFailed | object:
    """What a stream's reader gets of a chunk: the response, its failure or END."""
    if chunk.HasField("error"):
        return StreamFailed.of_chunk(chunk.error)
    return END if chunk.end else chunk.response

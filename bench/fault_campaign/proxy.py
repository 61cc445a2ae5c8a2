"""A TCP proxy between two mesh processes that, when armed, cuts its next bulk read in the middle
(both sockets reset, half the chunk delivered) or flips one bit in it. Runs its own event loop on
a thread so the processes' traffic does not wait on the campaign's."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading
from typing import Literal

Action = Literal["drop", "flip"]
READ_BYTES = 1 << 16


class FaultProxy:
    def __init__(self, target: str = "", min_bytes: int = 1 << 14) -> None:
        self.target = target                 # host:port; may be set after start (a port not yet bound)
        self._min_bytes = min_bytes          # only a read this large is a bulk chunk worth arming on
        self._armed: Action | None = None
        self._fired = threading.Event()
        self._connections: set[asyncio.StreamWriter] = set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fault-proxy", daemon=True)
        self.address = ""

    def start(self) -> "FaultProxy":
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._accept, "127.0.0.1", 0), self._loop).result(timeout=10)
        self.address = f"127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    def stop(self) -> None:
        async def close() -> None:
            self._server.close()
            for writer in list(self._connections):
                writer.transport.abort()
        asyncio.run_coroutine_threadsafe(close(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    def arm(self, action: Action) -> threading.Event:
        """The next read of at least min_bytes from the target is cut or corrupted; the returned event
        is set once it has been."""
        self._fired = threading.Event()
        self._armed = action
        return self._fired

    def disarm(self) -> None:
        self._armed = None

    @property
    def num_connections(self) -> int:
        return len(self._connections) // 2

    async def _accept(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        try:
            host, port = self.target.rsplit(":", 1)
            upstream_reader, upstream_writer = await asyncio.open_connection(host, int(port))
        except OSError:
            client_writer.transport.abort()
            return
        pair = (client_writer, upstream_writer)
        self._connections.update(pair)
        try:
            await asyncio.gather(self._pump(client_reader, upstream_writer, pair, from_target=False),
                                 self._pump(upstream_reader, client_writer, pair, from_target=True))
        finally:
            self._connections.difference_update(pair)
            for writer in pair:
                writer.transport.abort()

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    pair: tuple[asyncio.StreamWriter, ...], from_target: bool) -> None:
        try:
            while data := await reader.read(READ_BYTES):
                action = self._armed if from_target and len(data) >= self._min_bytes else None
                if action is not None:
                    self._armed = None
                    data = await self._inject(action, data, writer, pair)
                    if data is None:
                        return
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            for other in pair:
                other.transport.abort()
            return
        if writer.can_write_eof() and not writer.is_closing():   # end of stream: pass the half-close on
            with contextlib.suppress(OSError):
                writer.write_eof()

    async def _inject(self, action: Action, data: bytes, writer: asyncio.StreamWriter,
                      pair: tuple[asyncio.StreamWriter, ...]) -> bytes | None:
        if action == "flip":
            middle = len(data) // 2
            self._fired.set()
            return data[:middle] + bytes([data[middle] ^ 0x10]) + data[middle + 1:]
        writer.write(data[:len(data) // 2])
        await writer.drain()
        for other in pair:
            _reset(other)   # RST both ways, half a chunk delivered
        self._fired.set()
        return None


def _reset(writer: asyncio.StreamWriter) -> None:
    """Closes with a TCP RST (linger 0), as a crashed peer or a middlebox would, not a FIN."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()

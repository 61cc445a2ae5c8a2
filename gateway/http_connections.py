"""Per-connection limits of the gateway's HTTP server that aiohttp lacks: a cap on open connections and a
deadline for a new connection's first request head.

Slowloris: a client opens many connections and sends each request head a byte at a time; a server that
waits for heads with no deadline holds a socket (and its file descriptor) per connection forever, until it
can accept no more. Here a connection whose first request head has not arrived `header_timeout_s` after it
opened is closed (nginx's client_header_timeout, Go's ReadHeaderTimeout). Later requests on a keep-alive
connection are bounded by aiohttp's keepalive_timeout, which closes a connection still waiting for a whole
request head that long after the previous response.

Over `max_connections` open connections, a new one is answered 503 at once and closed, as nginx's
limit_conn and uvicorn's --limit-concurrency answer, instead of taking a socket the server cannot serve.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

from aiohttp import web

LINGER_S = 1.0   # a refused connection is read (and dropped) this long, so the client sees the 503, not a reset


class ConnectionGuard:
    """Makes the protocols of the server's connections: aiohttp's own while fewer than `max_connections`
    are open, a refusal past that; closes a connection whose first request head is late."""

    def __init__(self, max_connections: int, header_timeout_s: float) -> None:
        self._max_connections = max_connections
        self._header_timeout_s = header_timeout_s
        self.num_open = 0             # connections served (counted from accept, before connection_made)
        self.num_refused = 0          # connections answered 503 for being over the cap
        self.num_header_timeouts = 0  # connections closed for a first request head that came too late
        self._head_deadlines: dict[asyncio.BaseTransport, asyncio.TimerHandle] = {}
        self._refusals: set[_Refusal] = set()

    def protocol_factory(self, make_handler: Callable[[], asyncio.Protocol]) -> Callable[[], asyncio.Protocol]:
        def make() -> asyncio.Protocol:
            if self.num_open >= self._max_connections:
                self.num_refused += 1
                return _Refusal(self._max_connections, self._refusals)
            self.num_open += 1
            return _Guarded(make_handler(), self)
        return make

    def head_received(self, transport: asyncio.BaseTransport | None) -> None:
        """A request head arrived on the connection: its deadline is off."""
        deadline = self._head_deadlines.pop(transport, None) if transport is not None else None
        if deadline is not None:
            deadline.cancel()

    def close_refusals(self) -> None:
        for refusal in list(self._refusals):
            refusal.close()

    def connection_opened(self, transport: asyncio.BaseTransport) -> None:
        """(_Guarded) A served connection opened: its first request head is due within header_timeout_s."""
        loop = asyncio.get_running_loop()
        self._head_deadlines[transport] = loop.call_later(self._header_timeout_s, self._head_late, transport)

    def connection_closed(self, transport: asyncio.BaseTransport | None) -> None:
        """(_Guarded) A served connection closed: its slot is free."""
        self.num_open -= 1
        self.head_received(transport)

    def _head_late(self, transport: asyncio.BaseTransport) -> None:
        if self._head_deadlines.pop(transport, None) is not None:
            self.num_header_timeouts += 1
            transport.close()


class _Guarded(asyncio.Protocol):
    """aiohttp's protocol for one connection, with the guard told when it opens and closes."""

    def __init__(self, handler: asyncio.Protocol, guard: ConnectionGuard) -> None:
        self._handler = handler
        self._guard = guard
        self._transport: asyncio.BaseTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport
        self._guard.connection_opened(transport)
        self._handler.connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self._guard.connection_closed(self._transport)
        self._handler.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self._handler.data_received(data)

    def eof_received(self) -> bool | None:
        return self._handler.eof_received()

    def pause_writing(self) -> None:
        self._handler.pause_writing()

    def resume_writing(self) -> None:
        self._handler.resume_writing()


class _Refusal(asyncio.Protocol):
    """Answers 503 and closes: the response goes out at once, then what the client sends is read and dropped
    for up to LINGER_S (closing with its request unread would reset the connection, losing the 503)."""

    def __init__(self, max_connections: int, refusals: set[_Refusal]) -> None:
        self._response = _service_unavailable(f"the gateway has {max_connections} connections open (its limit); "
                                               "retry later")
        self._refusals = refusals
        self._transport: asyncio.Transport | None = None
        self._linger: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        self._refusals.add(self)
        transport.write(self._response)
        transport.write_eof()
        self._linger = asyncio.get_running_loop().call_later(LINGER_S, self.close)

    def data_received(self, data: bytes) -> None:
        pass

    def eof_received(self) -> bool:
        return False   # the transport closes

    def connection_lost(self, exc: Exception | None) -> None:
        self._refusals.discard(self)
        if self._linger is not None:
            self._linger.cancel()

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()


def _service_unavailable(message: str) -> bytes:
    """A whole HTTP/1.1 503 response, its body in the OpenAI error shape the API answers with."""
    body = json.dumps({"error": {"message": message, "type": "HTTPServiceUnavailable", "code": 503}}).encode()
    head = ("HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
            f"Connection: close\r\nContent-Length: {len(body)}\r\n\r\n")
    return head.encode() + body


class GuardedSite(web.BaseSite):
    """aiohttp's TCPSite, serving through a ConnectionGuard."""

    def __init__(self, runner: web.BaseRunner, host: str, port: int, guard: ConnectionGuard,
                 backlog: int = 128) -> None:
        super().__init__(runner, backlog=backlog)
        self._host, self._port = host, port
        self._guard = guard

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        assert self._runner.server is not None
        self._server = await asyncio.get_running_loop().create_server(
            self._guard.protocol_factory(self._runner.server), self._host, self._port, backlog=self._backlog)

    async def stop(self) -> None:
        await super().stop()
        self._guard.close_refusals()

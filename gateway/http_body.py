"""A request body read within its limits (size, time), and its JSON parsed in a way that lets a worker
thread parse a big body while the event loop keeps serving streams.

Parsing in a thread alone is not enough: the C JSON parser holds the GIL for a whole body (a 4 MiB body of
small objects, ~50 ms; a 60 MB one, a second), so the loop would wait for it all the same. A Python-level
object hook is a point where the interpreter can hand the GIL to the loop, once per JSON object. And the
hundreds of thousands of objects a big body makes start the garbage collector's full passes over every object
of the process, several of them, each holding the GIL ~0.1 s: the collector is paused while a body is parsed
(what it makes is freed by reference counting as soon as it is not needed).
"""

from __future__ import annotations

import asyncio
import gc
import json
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

from aiohttp import web

from pdmesh.errors import InvalidRequest

Parsed = TypeVar("Parsed")


async def read_body(request: web.Request, max_bytes: int, timeout_s: float) -> bytes:
    """The whole body. A declared length over `max_bytes` is refused (413) before a byte of it is read; an
    undeclared one (chunked) as soon as it passes the limit (aiohttp's client_max_size). A body that has not
    all arrived within `timeout_s` is 408 (a slow sender would hold the connection and its handler forever)."""
    if request.content_length is not None and request.content_length > max_bytes:
        raise web.HTTPRequestEntityTooLarge(max_size=max_bytes, actual_size=request.content_length)
    try:
        async with asyncio.timeout(timeout_s):
            return await request.read()
    except TimeoutError:
        raise web.HTTPRequestTimeout(text=f"the request body did not arrive within {timeout_s:g} s") from None


def loads(raw: bytes) -> object:
    """The JSON value of `raw` (meant for a worker thread, see the module's docstring); InvalidRequest if
    it is not JSON or is nested too deeply."""
    try:
        return json.loads(raw, object_pairs_hook=_object)
    except ValueError:
        raise InvalidRequest("the request body is not valid JSON") from None
    except RecursionError:
        raise InvalidRequest("the request body is nested too deeply") from None


def _object(pairs: list[tuple[str, object]]) -> dict:
    """A JSON object as json's default makes it (the last of duplicate keys wins); being Python code, it
    lets the GIL go to other threads between objects."""
    return dict(pairs)


def parse_without_gc(parse: Callable[[bytes], Parsed], raw: bytes) -> Parsed:
    """`parse(raw)` with the garbage collector paused (see the module's docstring)."""
    with _GC_PAUSE.held():
        return parse(raw)


class _GcPause:
    """The collector is off while any parse holds the pause, and left as found after the last (a collector
    turned off elsewhere stays off)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holders = 0
        self._was_enabled = False

    @contextmanager
    def held(self) -> Iterator[None]:
        with self._lock:
            if self._holders == 0:
                self._was_enabled = gc.isenabled()
                gc.disable()
            self._holders += 1
        try:
            yield
        finally:
            with self._lock:
                self._holders -= 1
                if self._holders == 0 and self._was_enabled:
                    gc.enable()


_GC_PAUSE = _GcPause()

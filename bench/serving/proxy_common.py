"""What the benchmark's HTTP proxies share: relaying a backend's streamed answer, /health, and
serving on a loopback port named in a ready file."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
from aiohttp import web


async def relay(answer: aiohttp.ClientResponse, request: web.Request) -> web.StreamResponse:
    """A backend's answer, streamed to the client as it comes."""
    response = web.StreamResponse(status=answer.status,
                                  headers={"Content-Type": answer.headers.get("Content-Type", "")})
    await response.prepare(request)
    async for data in answer.content.iter_any():
        await response.write(data)
    await response.write_eof()
    return response


async def health(_: web.Request) -> web.Response:
    return web.Response(text="ok")


async def serve_app(app: web.Application, ready_file: Path) -> None:
    """Serves `app` on 127.0.0.1 (a free port, written to `ready_file` as its URL) until killed."""
    app.router.add_get("/health", health)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    ready_file.write_text(json.dumps({"url": f"http://127.0.0.1:{port}"}))
    await asyncio.Event().wait()

"""Plain replicas behind one address, as a user would put them: each request goes to the backend
with the fewest requests outstanding (ties in turn), and its answer streams straight back.

python -m bench.serving.lor_proxy --backend URL --backend URL --ready-file F
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
from pathlib import Path

import aiohttp
from aiohttp import web

FORWARDED = ("/v1/completions", "/v1/chat/completions")
SESSION = web.AppKey("session", aiohttp.ClientSession)


async def relay(answer: aiohttp.ClientResponse, request: web.Request) -> web.StreamResponse:
    """A backend's answer, streamed to the client as it comes."""
    response = web.StreamResponse(status=answer.status,
                                  headers={"Content-Type": answer.headers.get("Content-Type", "")})
    await response.prepare(request)
    async for data in answer.content.iter_any():
        await response.write(data)
    await response.write_eof()
    return response


class LeastOutstanding:
    def __init__(self, backends: list[str]) -> None:
        self.outstanding = dict.fromkeys(backends, 0)
        self._turn = itertools.count()

    def pick(self) -> str:
        fewest = min(self.outstanding.values())
        tied = [b for b, n in self.outstanding.items() if n == fewest]
        return tied[next(self._turn) % len(tied)]


def make_app(backends: list[str]) -> web.Application:
    app = web.Application(client_max_size=64 << 20)
    chooser = LeastOutstanding(backends)

    async def session_ctx(app):
        app[SESSION] = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None),
                                               connector=aiohttp.TCPConnector(limit=0))
        yield
        await app[SESSION].close()

    async def forward(request: web.Request) -> web.StreamResponse:
        backend = chooser.pick()
        chooser.outstanding[backend] += 1
        try:
            async with request.app[SESSION].post(f"{backend}{request.path}", data=await request.read(),
                                                   headers={"Content-Type": "application/json"}) as answer:
                return await relay(answer, request)
        finally:
            chooser.outstanding[backend] -= 1

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    app.cleanup_ctx.append(session_ctx)
    for path in FORWARDED:
        app.router.add_post(path, forward)
    app.router.add_get("/health", health)
    return app


async def serve(backends: list[str], ready_file: Path) -> None:
    runner = web.AppRunner(make_app(backends))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    ready_file.write_text(json.dumps({"url": f"http://127.0.0.1:{port}"}))
    await asyncio.Event().wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", action="append", required=True)
    parser.add_argument("--ready-file", required=True)
    args = parser.parse_args()
    asyncio.run(serve(args.backend, Path(args.ready_file)))


if __name__ == "__main__":
    main()

"""Plain replicas behind one address, as a user would put them: each request goes to the backend
with the fewest requests outstanding (ties in turn), and its answer streams straight back.

python -m bench.serving.lor_proxy --backend URL --backend URL --ready-file F
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
from pathlib import Path

import aiohttp
from aiohttp import web

from bench.serving.proxy_common import relay, serve_app

FORWARDED = ("/v1/completions", "/v1/chat/completions")
SESSION = web.AppKey("session", aiohttp.ClientSession)


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

    app.cleanup_ctx.append(session_ctx)
    for path in FORWARDED:
        app.router.add_post(path, forward)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", action="append", required=True)
    parser.add_argument("--ready-file", required=True)
    args = parser.parse_args()
    asyncio.run(serve_app(make_app(args.backend), Path(args.ready_file)))


if __name__ == "__main__":
    main()

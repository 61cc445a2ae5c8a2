"""A stand-in OpenAI completions server for the benchmark's own client and proxy: streams
`max_tokens` one-token chunks `token_gap_s` apart, then the usage, as vLLM's server does."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

from aiohttp import web


class FakeCompletions:
    def __init__(self, token_gap_s: float = 0.001, first_token_s: float = 0.0) -> None:
        self.token_gap_s, self.first_token_s = token_gap_s, first_token_s
        self.bodies: list[dict] = []
        self.arrived_at: list[float] = []   # time.perf_counter() of each request
        self.outstanding = 0
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def start(self) -> "FakeCompletions":
        app = web.Application()
        app.router.add_post("/v1/completions", self._completions)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        return self

    async def stop(self) -> None:
        with contextlib.suppress(Exception):
            await self._runner.cleanup()

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        self.arrived_at.append(time.perf_counter())
        self.outstanding += 1
        try:
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            await asyncio.sleep(self.first_token_s)
            for i in range(body["max_tokens"]):
                if i:
                    await asyncio.sleep(self.token_gap_s)
                await response.write(_event({"choices": [{"index": 0, "text": f"<{i}>"}]}))
            await response.write(_event({"choices": [], "usage": {"completion_tokens": body["max_tokens"]}}))
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
            return response
        finally:
            self.outstanding -= 1


def _event(payload: dict) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()

"""vLLM's own disaggregated serving, the way its toy proxy drives it, for `bench.serve`.

python -m bench.vllm_disagg_proxy --prefill URL --decode URL --ready-file F

Two vLLM OpenAI servers share one KV connector (ExampleConnector: each layer's KV of a prompt is
written to a shared directory by the prefill server and read back by the decode server, which
then skips computing those tokens). Like vLLM's toy proxy (examples/online_serving/
disaggregated_serving), each /v1/completions request goes first to the prefill server with
max_tokens=1 (it computes the prompt and saves its KV), then, unchanged, to the decode server,
whose response streams back to the client.
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

import aiohttp
from aiohttp import web

from bench.serving.proxy_common import relay, serve_app


def make_app(prefill_url: str, decode_url: str) -> web.Application:
    app = web.Application()

    async def session_ctx(app):
        app["session"] = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        yield
        await app["session"].close()

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        session: aiohttp.ClientSession = request.app["session"]
        prefill_body = {**body, "max_tokens": 1, "stream": False}
        prefill_body.pop("stream_options", None)
        async with session.post(f"{prefill_url}/v1/completions", json=prefill_body) as prefilled:
            if prefilled.status != 200:
                return web.Response(status=prefilled.status, body=await prefilled.read(),
                                    content_type="application/json")
            await prefilled.read()
        async with session.post(f"{decode_url}/v1/completions", json=body) as decoded:
            return await relay(decoded, request)

    app.cleanup_ctx.append(session_ctx)
    app.router.add_post("/v1/completions", completions)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefill", required=True)
    parser.add_argument("--decode", required=True)
    parser.add_argument("--ready-file", required=True)
    args = parser.parse_args()
    asyncio.run(serve_app(make_app(args.prefill, args.decode), Path(args.ready_file)))


if __name__ == "__main__":
    main()

"""The benchmark's trace replayer and its least-outstanding proxy for plain replicas, against
stand-in OpenAI servers (the benchmark itself drives vLLM and the mesh)."""

import asyncio

import pytest
from aiohttp import web

from bench.serving.lor_proxy import LeastOutstanding, make_app
from bench.serving.replay import replay
from bench.serving.trace import HASH_BLOCK_TOKENS, TraceRequest
from tests.bench.serving.fake_openai import FakeCompletions

TRACE = [TraceRequest(0, 600, 4, (0, 1)), TraceRequest(300, 100, 1, (0,)), TraceRequest(600, 50, 3, (7,))]


async def test_a_trace_is_sent_on_its_timestamps_and_every_request_timed():
    server = await FakeCompletions(token_gap_s=0.01, first_token_s=0.05).start()
    try:
        result = await replay(server.url, "m", TRACE, speed=2.0, salt=5)   # twice as fast: 0, 150, 300 ms
    finally:
        await server.stop()
    gaps = [later - server.arrived_at[0] for later in server.arrived_at]
    assert gaps[1] == pytest.approx(0.15, abs=0.08) and gaps[2] == pytest.approx(0.30, abs=0.08)
    assert (result.num_sent, result.num_failed, result.output_tokens, len(result.timings)) == (3, 0, 8, 3)
    assert all(t.ttft_ms >= 50 for t in result.timings)
    four_tokens = next(t for t in result.timings if t.tpot_ms > 0 and t.max_itl_ms > 0)
    assert four_tokens.tpot_ms == pytest.approx(10.0, abs=8.0)
    bodies = sorted(server.bodies, key=lambda b: len(b["prompt"]))
    assert [len(b["prompt"]) for b in bodies] == [50, 100, 600]
    assert bodies[1]["prompt"] == bodies[2]["prompt"][:100]   # hash id 0 is the shared first block
    assert all(b["ignore_eos"] and b["stream"] and b["temperature"] == 0 for b in bodies)


async def test_a_server_that_refuses_counts_as_failed_requests():
    async def refuse(_):
        return web.Response(status=503, text="overloaded")

    app = web.Application()
    app.router.add_post("/v1/completions", refuse)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        result = await replay(f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}", "m", TRACE[:2], 10.0, 5)
    finally:
        await runner.cleanup()
    assert (result.num_sent, result.num_failed, result.timings) == (2, 2, [])
    assert "HTTP 503" in result.errors[0]


def test_ties_go_in_turn_and_the_least_outstanding_backend_wins():
    chooser = LeastOutstanding(["a", "b"])
    assert [chooser.pick(), chooser.pick()] == ["a", "b"]
    chooser.outstanding["a"] = 3
    assert {chooser.pick() for _ in range(4)} == {"b"}


async def test_the_proxy_streams_answers_and_sends_new_requests_to_the_idler_replica():
    slow, fast = await FakeCompletions(token_gap_s=0.2).start(), await FakeCompletions(token_gap_s=0.0).start()
    runner = web.AppRunner(make_app([slow.url, fast.url]))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    try:
        busy = asyncio.ensure_future(replay(url, "m", [TraceRequest(0, 8, 10, (0,))], 1.0, 5))   # 2 s on the slow one
        await asyncio.sleep(0.3)
        quick = await replay(url, "m", [TraceRequest(100 * i, 8, 2, (i,)) for i in range(4)], 1.0, 5)   # one at a time
        assert (quick.num_failed, quick.output_tokens) == (0, 8)
        assert (len(slow.bodies), len(fast.bodies)) == (1, 4)
        assert (await busy).output_tokens == 10
    finally:
        await runner.cleanup()
        await slow.stop()
        await fast.stop()


def test_trace_blocks_are_mooncakes_512_tokens():
    assert HASH_BLOCK_TOKENS == 512 and len(TraceRequest(0, 1000, 1, (3, 4)).prompt(salt=5)) == 1000


def test_a_salt_gives_other_prompts_and_keeps_shared_prefixes_shared():
    """Two speeds of one trace (or two traces with the same ids) must not hit each other's prefix cache."""
    longer, shorter = TraceRequest(0, 600, 1, (0, 1)), TraceRequest(0, 100, 1, (0,))
    assert longer.prompt(salt=5)[:100] == shorter.prompt(salt=5)
    assert longer.prompt(salt=5) == longer.prompt(salt=5)
    assert shorter.prompt(salt=6) != shorter.prompt(salt=5)

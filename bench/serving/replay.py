"""Replays a trace on its timestamps against an OpenAI completions endpoint (streamed, greedy,
`ignore_eos` so each answer has the trace's output length) and times every request: TTFT from the
send to the first token, TPOT over the rest, the longest gap between tokens. vLLM's load tool sends
at a rate or a concurrency, not at recorded times; AIPerf's trace mode does what this does.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import aiohttp

from bench.serving.goodput import Timing, tpot_ms
from bench.serving.trace import TraceRequest


@dataclass
class Replayed:
    num_sent: int = 0
    timings: list[Timing] = field(default_factory=list)   # of the completed requests
    num_failed: int = 0
    output_tokens: int = 0
    duration_s: float = 0.0
    errors: list[str] = field(default_factory=list)       # the first few


async def replay(base_url: str, model: str, requests: Sequence[TraceRequest], speed: float, salt: int,
                 timeout_s: float = 600.0) -> Replayed:
    """`salt` seeds the prompts' tokens (TraceRequest.prompt); they are all built before the clock starts."""
    result = Replayed(num_sent=len(requests))
    first = requests[0].timestamp if requests else 0
    prompts = [request.prompt(salt) for request in requests]
    started = time.perf_counter()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s),
                                     connector=aiohttp.TCPConnector(limit=0)) as session:
        async def send(request: TraceRequest, prompt: list[int]) -> None:
            await asyncio.sleep(max(0.0, started + (request.timestamp - first) / 1e3 / speed - time.perf_counter()))
            try:
                timing, num_tokens = await _one(session, base_url, model, prompt, request.output_length)
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
                result.num_failed += 1
                if len(result.errors) < 5:
                    result.errors.append(f"{type(exc).__name__}: {exc}"[:300])
                return
            result.timings.append(timing)
            result.output_tokens += num_tokens

        await asyncio.gather(*(send(r, p) for r, p in zip(requests, prompts)))
    result.duration_s = time.perf_counter() - started
    return result


async def _one(session: aiohttp.ClientSession, base_url: str, model: str, prompt: list[int],
               max_tokens: int) -> tuple[Timing, int]:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    sent = time.perf_counter()
    token_times: list[float] = []
    num_tokens = 0
    async with session.post(f"{base_url}/v1/completions", json=body) as response:
        if response.status != 200:
            raise ValueError(f"HTTP {response.status}: {(await response.text())[:200]}")
        async for line in response.content:
            data = line.decode().strip().removeprefix("data:").strip()
            if not data or data == "[DONE]":
                continue
            chunk = json.loads(data)
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                token_times.append(time.perf_counter())
            if chunk.get("usage"):
                num_tokens = chunk["usage"]["completion_tokens"]
    if not token_times:
        raise ValueError("no token came back")
    done = token_times[-1]
    gaps = [later - earlier for earlier, later in zip(token_times, token_times[1:])]
    ttft_s = token_times[0] - sent
    return Timing(1e3 * ttft_s, tpot_ms(done - sent, ttft_s, num_tokens or len(token_times)),
                  1e3 * max(gaps, default=0.0)), num_tokens or len(token_times)

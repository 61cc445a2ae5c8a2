"""A concurrent stream load on the gateway: each stream sends the workload's prompts one after
another and records each request's outcome against monolithic vLLM's tokens."""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field

import grpc

from bench.fault_campaign.outcomes import RequestResult, classify
from pdmesh.client import make_request
from pdmesh.transport.grpc_options import GRPC_OPTIONS
from pdmesh.v1 import generate_pb2_grpc


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    expected: list[list[int]]      # monolithic vLLM's greedy tokens, one list per prompt
    max_tokens: int


@dataclass
class StreamLoad:
    gateway_address: str
    workload: Workload
    num_streams: int = 16
    hang_s: float = 120.0          # longer than the gateway's own request deadline (MeshSpec.hang_s)
    results: list[RequestResult] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._next_prompt = itertools.count()
        self._stopping = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._in_flight = 0
        self._running = asyncio.Event()
        self._running.set()
        self._idle = asyncio.Event()

    @property
    def in_flight(self) -> int:
        return self._in_flight

    async def __aenter__(self) -> "StreamLoad":
        self._channel = grpc.aio.insecure_channel(self.gateway_address, options=GRPC_OPTIONS)
        stub = generate_pb2_grpc.GenerationStub(self._channel)
        self._tasks = [asyncio.create_task(self._stream(stub)) for _ in range(self.num_streams)]
        return self

    async def __aexit__(self, *exc) -> None:
        """Lets every stream finish the request it is in (each bounded by hang_s), then closes."""
        self._stopping.set()
        self._running.set()
        await asyncio.gather(*self._tasks)
        await self._channel.close()

    async def pause(self) -> None:
        """No new requests until resume(); returns once those in flight have ended."""
        self._running.clear()
        self._idle.clear()
        if self._in_flight:
            await self._idle.wait()

    def resume(self) -> None:
        self._running.set()

    async def _stream(self, stub: generate_pb2_grpc.GenerationStub) -> None:
        while not self._stopping.is_set():
            await self._running.wait()
            if self._stopping.is_set():   # stopped while paused
                break
            index = next(self._next_prompt) % len(self.workload.prompts)
            self._in_flight += 1
            try:
                self.results.append(await self._request(stub, index))
            finally:
                self._in_flight -= 1
                if not self._in_flight:
                    self._idle.set()

    async def _request(self, stub: generate_pb2_grpc.GenerationStub, index: int) -> RequestResult:
        request = make_request(self.workload.prompts[index], max_tokens=self.workload.max_tokens,
                               ignore_eos=True)
        tokens: list[int] = []
        error, hung = None, False
        started = time.monotonic()
        call = stub.Generate(request)
        try:
            async with asyncio.timeout(self.hang_s):
                async for response in call:
                    tokens.extend(response.token_ids)
        except grpc.aio.AioRpcError as exc:
            error = exc
        except TimeoutError:
            hung = True
            call.cancel()
        outcome, detail = classify(tokens, self.workload.expected[index], error, hung)
        return RequestResult(index, started, time.monotonic(), outcome, detail)

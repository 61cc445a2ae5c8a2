"""A concurrent stream load on the gateway: each stream sends the workload's prompts one after
another and records each request's outcome against monolithic vLLM's tokens.

The load's streams are one tenant's (an API key). A probe stream, another tenant's, sends the same
prompts with a cache salt of its own on every request (vLLM's per-request cache_salt on top of its
tenant's): no probe request may reuse a single cached token, so any prefill-cached token on a
probe's response is another tenant's KV — a breach of tenant isolation. (A probe that failed over
may reuse its own first attempt's KV: those are not judged.)"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from dataclasses import dataclass, field

import grpc

from bench.fault_campaign.outcomes import RequestResult, classify
from pdmesh.client import auth_metadata, make_request
from pdmesh.transport.grpc_options import GRPC_OPTIONS
from pdmesh.v1 import generate_pb2, generate_pb2_grpc

REMOTE_TIER = "remote"   # prefill_store_tokens' label of tokens fetched from another node (connector/store_agent.py)


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    expected: list[list[int]]      # monolithic vLLM's greedy tokens, one list per prompt
    max_tokens: int


@dataclass(frozen=True)
class Tenant:
    api_key: str = ""              # "": the gateway has no API keys
    salt_each_request: bool = False  # a cache salt of its own on every request: it may reuse no cached token


@dataclass
class StreamLoad:
    gateway_address: str
    workload: Workload
    num_streams: int = 16
    hang_s: float = 120.0          # longer than the gateway's own request deadline (MeshSpec.hang_s)
    tenant: Tenant = Tenant()      # the load's streams
    probe: Tenant | None = None    # one more stream, of this tenant
    results: list[RequestResult] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._next_prompt = itertools.count()
        self._next_probe = itertools.count()
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
        streams = [(self.tenant, False)] * self.num_streams + ([(self.probe, True)] if self.probe is not None else [])
        self._tasks = [asyncio.create_task(self._stream(stub, tenant, probe)) for tenant, probe in streams]
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

    async def _stream(self, stub: generate_pb2_grpc.GenerationStub, tenant: Tenant, probe: bool) -> None:
        prompts = self._next_probe if probe else self._next_prompt
        while not self._stopping.is_set():
            await self._running.wait()
            if self._stopping.is_set():   # stopped while paused
                break
            index = next(prompts) % len(self.workload.prompts)
            self._in_flight += 1
            try:
                self.results.append(await self._request(stub, index, tenant, probe))
            finally:
                self._in_flight -= 1
                if not self._in_flight:
                    self._idle.set()

    async def _request(self, stub: generate_pb2_grpc.GenerationStub, index: int, tenant: Tenant,
                       probe: bool) -> RequestResult:
        request_id = uuid.uuid4().hex
        request = make_request(self.workload.prompts[index], max_tokens=self.workload.max_tokens,
                               request_id=request_id, ignore_eos=True)
        if tenant.salt_each_request:
            request.cache_salt = uuid.uuid4().hex
        tokens: list[int] = []
        transfer = generate_pb2.TransferStats()   # the last message's: the route, the KV's way
        error, hung = None, False
        started = time.monotonic()
        call = stub.Generate(request, metadata=auth_metadata(tenant.api_key))
        try:
            async with asyncio.timeout(self.hang_s):
                async for response in call:
                    tokens.extend(response.token_ids)
                    if response.HasField("transfer"):   # the last message
                        transfer = response.transfer
        except grpc.aio.AioRpcError as exc:
            error = exc
        except TimeoutError:
            hung = True
            call.cancel()
        outcome, detail = classify(tokens, self.workload.expected[index], error, hung)
        return RequestResult(index, started, time.monotonic(), outcome, detail, probe=probe,
                             prefill_cached_tokens=transfer.prefill_cached_tokens,
                             num_failovers=transfer.num_failovers, request_id=request_id,
                             prefill_worker=transfer.prefill_worker, decode_worker=transfer.decode_worker,
                             remote_store_tokens=transfer.prefill_store_tokens.get(REMOTE_TIER, 0))

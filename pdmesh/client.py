"""Minimal client of the gateway's Generation API (protos and grpc only)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

import grpc

from pdmesh.transport.grpc_options import GRPC_OPTIONS
from pdmesh.v1 import common_pb2, generate_pb2, generate_pb2_grpc


def make_request(prompt: str | Sequence[int], max_tokens: int = 32, temperature: float = 0.0,
                 request_id: str = "", **sampling_fields) -> generate_pb2.GenerateRequest:
    sampling = common_pb2.SamplingParams(max_tokens=max_tokens, temperature=temperature, **sampling_fields)
    if isinstance(prompt, str):
        return generate_pb2.GenerateRequest(request_id=request_id, text=prompt, sampling=sampling)
    return generate_pb2.GenerateRequest(
        request_id=request_id, token_ids=generate_pb2.TokenIds(ids=list(prompt)), sampling=sampling)


def auth_metadata(api_key: str | None) -> tuple[tuple[str, str], ...]:
    """gRPC metadata carrying an API key the way the gateway reads it."""
    return (("authorization", f"Bearer {api_key}"),) if api_key else ()


async def stream_generate(address: str, request: generate_pb2.GenerateRequest, timeout_s: float = 300.0,
                          api_key: str | None = None) -> AsyncIterator[generate_pb2.GenerateResponse]:
    async with grpc.aio.insecure_channel(address, options=GRPC_OPTIONS) as channel:
        async for response in generate_pb2_grpc.GenerationStub(channel).Generate(
                request, timeout=timeout_s, metadata=auth_metadata(api_key)):
            yield response


async def generate(address: str, request: generate_pb2.GenerateRequest,
                   api_key: str | None = None) -> tuple[list[int], str, generate_pb2.GenerateResponse]:
    """Collects the whole stream: (token ids, text, last message)."""
    token_ids: list[int] = []
    pieces: list[str] = []
    last = generate_pb2.GenerateResponse()
    async for response in stream_generate(address, request, api_key=api_key):
        token_ids.extend(response.token_ids)
        pieces.append(response.text)
        last = response
    return token_ids, "".join(pieces), last

"""OpenAI-compatible HTTP API of the gateway (aiohttp): /v1/completions, /v1/chat/completions, /v1/models.

A client that disconnects cancels its handler (handler_cancellation); the CancelledError reaches the
generator's iterator, which is closed in every case, so the mesh stops the request.

Limits (HttpLimits; GatewaySettings' http_* settings say each one's default and why): connections open,
a new connection's first request head, idle keep-alive, body size and body time. A request is checked
against admission (the gateway's in-flight slots) before its body is read; its body is parsed, validated
and (chat) rendered by the template in a worker thread, so a big one does not stall the other streams.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

from aiohttp import web

from gateway.admission import Admission
from gateway.auth import ApiKeyAuth
from gateway.chat_template import ChatTemplate
from gateway.http_body import Parsed, loads, parse_without_gc, read_body
from gateway.http_connections import ConnectionGuard, GuardedSite
from gateway.openai_protocol import (COMPLETIONS_DEFAULT_MAX_TOKENS, ChatCompletionRequest, CompletionRequest,
                                     chat_prompt_text, chat_to_generate, completion_to_generate, parse_request)
from gateway.openai_replies import ChatReply, CompletionReply, Reply, ReplyHeader
from gateway.tokenizer import PromptTokenizer
from pdmesh.config import GatewaySettings
from pdmesh.errors import PDMeshError, Unauthenticated
from pdmesh.status_map import http_status_of
from pdmesh.v1 import common_pb2, generate_pb2

logger = logging.getLogger(__name__)
PARSE_THREADS = 2   # bodies parsed at once; more wait their turn (each is at most max_body_bytes)


@dataclass(frozen=True)
class HttpLimits:
    """GatewaySettings' http_* settings, which say what each bounds, its default and why."""
    max_body_bytes: int
    body_timeout_s: float
    header_timeout_s: float
    keepalive_timeout_s: float
    max_connections: int

    @classmethod
    def of(cls, settings: GatewaySettings) -> HttpLimits:
        return cls(settings.http_max_body_bytes, settings.http_body_timeout_s, settings.http_header_timeout_s,
                   settings.http_keepalive_timeout_s, settings.http_max_connections)


class GenerationSource(Protocol):
    """What the server drives: gateway.generation.MeshGenerator (fakes in unit tests)."""

    def stream(self, request: generate_pb2.GenerateRequest, tenant: str,
               timeout_s: float | None = None) -> AsyncIterator[generate_pb2.GenerateResponse]: ...

    async def list_models(self) -> generate_pb2.ListModelsResponse: ...

    async def max_model_len(self) -> int: ...

    @property
    def max_tokens_limit(self) -> int | None: ...

    @property
    def admission(self) -> Admission: ...


class OpenAIHttpServer:
    def __init__(self, generator: GenerationSource, auth: ApiKeyAuth, tokenizer: PromptTokenizer,
                 chat_template: ChatTemplate, limits: HttpLimits, shutdown_timeout_s: float = 5.0) -> None:
        self._generator = generator
        self._auth = auth
        self._tokenizer = tokenizer
        self._chat_template = chat_template
        self._limits = limits
        self._shutdown_timeout_s = shutdown_timeout_s
        self._created = int(time.time())
        self.connections = ConnectionGuard(limits.max_connections, limits.header_timeout_s)
        self._runner: web.AppRunner | None = None
        self._parsers: ThreadPoolExecutor | None = None

    async def start(self, host: str, port: int) -> str:
        """Serves on host:port (0: a free port); returns the "host:port" bound."""
        self._parsers = ThreadPoolExecutor(PARSE_THREADS, thread_name_prefix="pdmesh-http-body")
        self._runner = web.AppRunner(self._app(), handler_cancellation=True, access_log=None,
                                     shutdown_timeout=self._shutdown_timeout_s,
                                     keepalive_timeout=self._limits.keepalive_timeout_s)
        await self._runner.setup()
        await GuardedSite(self._runner, host, port, self.connections).start()
        return f"{host}:{self._runner.addresses[0][1]}"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._parsers is not None:
            self._parsers.shutdown(wait=True, cancel_futures=True)   # a parse under way is bounded by the body's size
            self._parsers = None

    def _app(self) -> web.Application:
        app = web.Application(middlewares=[self._head_received, _errors_as_json],
                              client_max_size=self._limits.max_body_bytes)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat_completions)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", _health)
        return app

    @web.middleware
    async def _head_received(self, request: web.Request, handler) -> web.StreamResponse:
        self.connections.head_received(request.transport)
        return await handler(request)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        tenant = self._tenant_with_room(request)
        body = await self._parsed(request, _completion_request)
        prompt_ids = await self._completion_prompt_ids(body) if body.return_token_ids or body.max_tokens is None \
            else None
        request_id = uuid.uuid4().hex
        generate = completion_to_generate(body, request_id, await self._completion_max_tokens(body, prompt_ids),
                                          prompt_ids)
        reply = CompletionReply(await self._header(f"cmpl-{request_id}", body.model), body.include_usage,
                                body.return_token_ids, prompt_ids)
        return await self._respond(request, generate, tenant, reply, bool(body.stream))

    async def _chat_completions(self, request: web.Request) -> web.StreamResponse:
        tenant = self._tenant_with_room(request)
        body, prompt_text = await self._parsed(request, functools.partial(_chat_request, self._chat_template))
        prompt_ids = await self._encode(prompt_text, add_special_tokens=False)
        request_id = uuid.uuid4().hex
        max_tokens = body.requested_max_tokens or self._within_limit(await self._room_after(prompt_ids))
        generate = chat_to_generate(body, request_id, prompt_ids, max_tokens)
        reply = ChatReply(await self._header(f"chatcmpl-{request_id}", body.model), body.include_usage,
                          body.return_token_ids, prompt_ids)
        return await self._respond(request, generate, tenant, reply, bool(body.stream))

    async def _models(self, request: web.Request) -> web.Response:
        self._tenant(request)
        listed = await self._generator.list_models()
        cards = [{"id": card.id, "object": "model", "created": self._created, "owned_by": "pdmesh",
                  "max_model_len": card.max_model_len} for card in listed.models]
        return web.json_response({"object": "list", "data": cards})

    def _tenant(self, request: web.Request) -> str:
        return self._auth.tenant_of(request.headers.get("Authorization"))

    def _tenant_with_room(self, request: web.Request) -> str:
        """The caller's tenant, once admission has a slot for it: a full gateway (or tenant) answers 429
        before the body is read and parsed. The stream takes the slot for real later (one may fill meanwhile)."""
        tenant = self._tenant(request)
        with self._generator.admission.admit(tenant):
            pass
        return tenant

    async def _parsed(self, request: web.Request, parse: Callable[[bytes], Parsed]) -> Parsed:
        """The body, read within the limits, then `parse`d in a worker thread."""
        raw = await read_body(request, self._limits.max_body_bytes, self._limits.body_timeout_s)
        assert self._parsers is not None
        return await asyncio.get_running_loop().run_in_executor(self._parsers, parse_without_gc, parse, raw)

    async def _completion_prompt_ids(self, body: CompletionRequest) -> list[int]:
        """The prompt ids the mesh will run (sent as ids): text tokenized with special tokens, as the mesh does."""
        prompt = body.single_prompt()
        return await self._encode(prompt) if isinstance(prompt, str) else list(prompt)

    async def _encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Tokenized off the event loop; a text the context cannot hold is refused untokenized."""
        return await self._tokenizer.encode_async(text, await self._generator.max_model_len(), add_special_tokens)

    async def _completion_max_tokens(self, body: CompletionRequest, prompt_ids: list[int] | None) -> int:
        """vLLM's: 16 when the body leaves max_tokens out, the rest of the context when it is null. A
        default is cut to the gateway's limit; a value the client set is checked against it instead."""
        if "max_tokens" not in body.model_fields_set:
            return self._within_limit(COMPLETIONS_DEFAULT_MAX_TOKENS)
        return body.max_tokens or self._within_limit(await self._room_after(prompt_ids))

    def _within_limit(self, default_max_tokens: int) -> int:
        limit = self._generator.max_tokens_limit
        return default_max_tokens if limit is None else min(default_max_tokens, limit)

    async def _room_after(self, prompt_ids: list[int]) -> int:
        """max_tokens when the client sets none: the rest of the context (at least 1, so an overlong
        prompt is reported as such by the mesh)."""
        return max(await self._generator.max_model_len() - len(prompt_ids), 1)

    async def _header(self, reply_id: str, model: str) -> ReplyHeader:
        if not model:
            listed = await self._generator.list_models()
            model = listed.models[0].id if listed.models else ""
        return ReplyHeader(reply_id, model, int(time.time()))

    async def _respond(self, request: web.Request, generate: generate_pb2.GenerateRequest, tenant: str,
                       reply: Reply, stream: bool) -> web.StreamResponse:
        responses = self._generator.stream(generate, tenant)
        try:
            if stream:
                return await _stream_events(request, responses, reply)
            return web.json_response(await _whole_body(responses, reply))
        finally:
            await _close(responses)


async def _whole_body(responses: AsyncIterator[generate_pb2.GenerateResponse], reply: Reply) -> dict:
    texts: list[str] = []
    token_ids: list[int] = []
    finish_reason, usage = common_pb2.FINISH_REASON_UNSPECIFIED, common_pb2.Usage()
    async for response in responses:
        texts.append(response.text)
        token_ids.extend(response.token_ids)
        finish_reason = response.finish_reason or finish_reason
        usage = response.usage if response.HasField("usage") else usage
    return reply.body("".join(texts), token_ids, finish_reason, usage)


async def _stream_events(request: web.Request, responses: AsyncIterator[generate_pb2.GenerateResponse],
                         reply: Reply) -> web.StreamResponse:
    """SSE. The first response is awaited before the headers go out, so an early error (overloaded,
    invalid) is a plain HTTP error; a later one is a final `error` event without [DONE]."""
    first = await anext(responses, None)
    sse = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await sse.prepare(request)
    try:
        await _send_events(sse, responses, first, reply)
    except ConnectionResetError:
        logger.info("client went away mid-stream")
        return sse
    except Exception as exc:  # noqa: BLE001 - reported to the client as the stream's last event
        await _send_error_event(sse, exc)
    with contextlib.suppress(ConnectionResetError):
        await sse.write_eof()
    return sse


async def _send_events(sse: web.StreamResponse, responses: AsyncIterator[generate_pb2.GenerateResponse],
                       first: generate_pb2.GenerateResponse | None, reply: Reply) -> None:
    usage = common_pb2.Usage()
    for event in reply.opening_events():
        await _send(sse, event)
    response, is_first = first, True
    while response is not None:
        await _send(sse, reply.chunk_event(response, is_first))
        usage = response.usage if response.HasField("usage") else usage
        response, is_first = await anext(responses, None), False
    for event in reply.closing_events(usage):
        await _send(sse, event)
    await sse.write(b"data: [DONE]\n\n")


async def _send(sse: web.StreamResponse, event: dict) -> None:
    await sse.write(f"data: {json.dumps(event)}\n\n".encode())


async def _send_error_event(sse: web.StreamResponse, exc: Exception) -> None:
    status, body = _error_body(exc)
    if status == 500:
        logger.exception("request failed mid-stream")
    with contextlib.suppress(ConnectionResetError):
        await _send(sse, body)


async def _close(responses: AsyncIterator) -> None:
    """Stops the generator (an async generator's finally blocks run now, not at garbage collection)."""
    aclose = getattr(responses, "aclose", None)
    try:
        if aclose is not None:
            await aclose()
    except Exception:  # noqa: BLE001 - the reply is already decided; a failed cleanup is only logged
        logger.exception("closing the generator's stream failed")


def _completion_request(raw: bytes) -> CompletionRequest:
    return parse_request(CompletionRequest, loads(raw))


def _chat_request(template: ChatTemplate, raw: bytes) -> tuple[ChatCompletionRequest, str]:
    """The request, without its messages, and its prompt text (the messages rendered by the chat template):
    the text is all the request needs of them, and 100k message objects kept alive through the request would
    make each of the collector's full passes meanwhile slow."""
    body = parse_request(ChatCompletionRequest, loads(raw))
    return body.model_copy(update={"messages": []}), chat_prompt_text(body, template)


async def _health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


@web.middleware
async def _errors_as_json(request: web.Request, handler) -> web.StreamResponse:
    """Domain errors as their HTTP status; aiohttp's own (a body over the limit, an unknown route)
    in the same JSON shape; anything unexpected as 500 (logged). Cancellation passes."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        error = {"message": exc.text or exc.reason, "type": type(exc).__name__, "code": exc.status}
        return web.json_response({"error": error}, status=exc.status)
    except Exception as exc:  # noqa: BLE001 - the server answers every request
        status, body = _error_body(exc)
        if status == 500:
            logger.exception("%s %s failed", request.method, request.path)
        headers = {"WWW-Authenticate": "Bearer"} if isinstance(exc, Unauthenticated) else None
        return web.json_response(body, status=status, headers=headers)


def _error_body(exc: Exception) -> tuple[int, dict]:
    if isinstance(exc, PDMeshError):
        status, message, kind = http_status_of(exc), str(exc), type(exc).__name__
    else:
        status, message, kind = 500, "internal server error", "InternalServerError"
    return status, {"error": {"message": message, "type": kind, "code": status}}

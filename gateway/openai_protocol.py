"""OpenAI request bodies (pydantic), their conversion to GenerateRequest, and the response bodies."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gateway.chat_template import ChatTemplate
from pdmesh.errors import InvalidRequest
from pdmesh.v1 import common_pb2, generate_pb2

COMPLETIONS_DEFAULT_MAX_TOKENS = 16   # OpenAI's default for /v1/completions

# The proto's integer widths, checked here so an overflow is a 400, not a failed conversion.
Int32 = Annotated[int, Field(ge=-2**31, le=2**31 - 1)]
Int64 = Annotated[int, Field(ge=-2**63, le=2**63 - 1)]

FINISH_REASONS = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_ABORT: "abort",
}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool | None = False


class _GenerationRequest(BaseModel):
    """Fields both endpoints share; unknown fields are ignored."""
    model_config = ConfigDict(extra="ignore")
    model: str = ""
    temperature: float | None = Field(1.0, ge=0, le=2, allow_inf_nan=False)   # vLLM's and OpenAI's bounds
    top_p: float | None = Field(1.0, gt=0, le=1, allow_inf_nan=False)
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = 1
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False       # vLLM extension
    return_token_ids: bool = False  # vLLM extension
    cache_salt: str | None = None   # vLLM extension
    user: str | None = None         # accepted, ignored

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def unsupported(self) -> list[str]:
        """Requested features the mesh cannot honour (each a message)."""
        return _requested([
            (self.n not in (None, 1), f"n={self.n} is not supported: only n=1"),
            (bool(self.presence_penalty), "presence_penalty is not supported"),
            (bool(self.frequency_penalty), "frequency_penalty is not supported"),
            (bool(self.logit_bias), "logit_bias is not supported"),
        ])


def _requested(checks: list[tuple[bool, str]]) -> list[str]:
    """The messages of the checks that hold."""
    return [message for holds, message in checks if holds]


class CompletionRequest(_GenerationRequest):
    prompt: str | list[Int32] | list[str] | list[list[Int32]]
    max_tokens: Int32 | None = Field(COMPLETIONS_DEFAULT_MAX_TOKENS, ge=1)
    logprobs: int | None = None
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None

    def unsupported(self) -> list[str]:
        return super().unsupported() + _requested([
            (self.logprobs is not None, "logprobs is not supported"),
            (bool(self.echo), "echo is not supported"),
            (self.best_of not in (None, 1), f"best_of={self.best_of} is not supported: only 1"),
            (bool(self.suffix), "suffix is not supported"),
        ])

    def single_prompt(self) -> str | list[int]:
        """The one prompt: a string or token ids (a list holding exactly one of them is unwrapped)."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise InvalidRequest(f"batched prompts are not supported: send 1 prompt per request, got {len(prompt)}")
            prompt = prompt[0]
        if not prompt:
            raise InvalidRequest("prompt is empty")
        return prompt


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None

    def template_dict(self) -> dict:
        """The message as the chat template sees it."""
        return self.model_dump(exclude_none=True) | {"content": self.content}


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int32 | None = Field(None, ge=1)
    max_tokens: Int32 | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    response_format: dict[str, Any] | None = None
    add_generation_prompt: bool = True   # vLLM extension

    def unsupported(self) -> list[str]:
        return super().unsupported() + _requested([
            (bool(self.logprobs) or bool(self.top_logprobs), "logprobs is not supported"),
            (bool(self.tools), "tools are not supported"),
            (bool(self.response_format) and self.response_format.get("type") != "text",
             "response_format is not supported (only {'type': 'text'})"),
        ])

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


def parse_request(model: type[_GenerationRequest], body: Any) -> _GenerationRequest:
    """The validated request; InvalidRequest naming the bad fields, or the unsupported features asked for."""
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    try:
        request = model.model_validate(body)
    except ValidationError as exc:
        raise InvalidRequest(_validation_message(exc)) from None
    unsupported = request.unsupported()
    if unsupported:
        raise InvalidRequest("; ".join(unsupported))
    return request


def _validation_message(exc: ValidationError) -> str:
    problems = [f"{'.'.join(str(part) for part in error['loc']) or 'body'}: {error['msg']}"
                for error in exc.errors(include_url=False)]
    return "invalid request: " + "; ".join(problems)


def completion_to_generate(body: CompletionRequest, request_id: str, default_max_tokens: int | None = None,
                           prompt_token_ids: list[int] | None = None) -> generate_pb2.GenerateRequest:
    """A text prompt travels as text (the mesh tokenizes it with special tokens), unless the caller
    has tokenized it already (`prompt_token_ids`); ids as ids. `default_max_tokens` replaces an
    explicit `max_tokens: null`."""
    request = _generate_request(body, request_id, body.max_tokens or default_max_tokens)
    prompt = body.single_prompt() if prompt_token_ids is None else prompt_token_ids
    if isinstance(prompt, str):
        request.text = prompt
    else:
        request.token_ids.ids.extend(prompt)
    return request


def chat_to_generate(body: ChatCompletionRequest, request_id: str, prompt_token_ids: list[int],
                     default_max_tokens: int | None = None) -> generate_pb2.GenerateRequest:
    """`prompt_token_ids`: the rendered chat (chat_prompt_text), tokenized."""
    request = _generate_request(body, request_id, body.requested_max_tokens or default_max_tokens)
    request.token_ids.ids.extend(prompt_token_ids)
    return request


def chat_prompt_text(body: ChatCompletionRequest, template: ChatTemplate) -> str:
    """The messages rendered by the chat template; tokenized without special tokens (the template
    writes them itself), as vLLM does for chat."""
    return template.render([m.template_dict() for m in body.messages], body.add_generation_prompt)


def _generate_request(body: _GenerationRequest, request_id: str,
                      max_tokens: int | None) -> generate_pb2.GenerateRequest:
    if max_tokens is None:
        raise InvalidRequest("max_tokens is required")
    sampling = common_pb2.SamplingParams(
        max_tokens=max_tokens, temperature=_or(body.temperature, 1.0), top_p=_or(body.top_p, 1.0),
        stop=_stop_list(body.stop), ignore_eos=body.ignore_eos)
    if body.seed is not None:
        sampling.seed = body.seed
    return generate_pb2.GenerateRequest(request_id=request_id, model=body.model, sampling=sampling,
                                        cache_salt=body.cache_salt or "")


def _or(value: float | None, default: float) -> float:
    return default if value is None else value


def _stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


# ---- responses ----

@dataclass(frozen=True)
class ReplyHeader:
    """What every body and chunk of one reply repeats."""
    id: str          # "cmpl-<request_id>" or "chatcmpl-<request_id>"
    model: str
    created: int     # unix seconds

    def fields(self, object_name: str) -> dict:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model}


def finish_reason_name(finish_reason: int) -> str | None:
    return FINISH_REASONS.get(finish_reason)


def usage_dict(usage: common_pb2.Usage) -> dict:
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_prompt_tokens}}


def completion_body(header: ReplyHeader, text: str, finish_reason: int, usage: common_pb2.Usage,
                    token_ids: list[int] | None = None, prompt_token_ids: list[int] | None = None) -> dict:
    """A whole /v1/completions reply; ids only when return_token_ids (prompt ids in the choice, as vLLM)."""
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason_name(finish_reason)}
    return {**header.fields("text_completion"), "choices": [_with_ids(choice, token_ids, prompt_token_ids)],
            "usage": usage_dict(usage)}


def chat_body(header: ReplyHeader, text: str, finish_reason: int, usage: common_pb2.Usage,
              token_ids: list[int] | None = None, prompt_token_ids: list[int] | None = None) -> dict:
    """A whole /v1/chat/completions reply; prompt ids at the top level (as vLLM)."""
    choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
              "finish_reason": finish_reason_name(finish_reason)}
    body = {**header.fields("chat.completion"), "choices": [_with_ids(choice, token_ids)], "usage": usage_dict(usage)}
    return _with_prompt_ids(body, prompt_token_ids)


def completion_chunk(header: ReplyHeader, text: str, finish_reason: int, include_usage: bool,
                     token_ids: list[int] | None = None, prompt_token_ids: list[int] | None = None) -> dict:
    """One streamed text_completion event; prompt ids (first chunk only) in the choice, as vLLM."""
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason_name(finish_reason)}
    chunk = {**header.fields("text_completion"), "choices": [_with_ids(choice, token_ids, prompt_token_ids)]}
    return _with_null_usage(chunk, include_usage)


def chat_chunk(header: ReplyHeader, delta: dict, finish_reason: int, include_usage: bool,
               token_ids: list[int] | None = None, prompt_token_ids: list[int] | None = None) -> dict:
    """One streamed chat.completion.chunk event; prompt ids (first chunk only) at the top level."""
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason_name(finish_reason)}
    chunk = {**header.fields("chat.completion.chunk"), "choices": [_with_ids(choice, token_ids)]}
    return _with_prompt_ids(_with_null_usage(chunk, include_usage), prompt_token_ids)


def usage_chunk(header: ReplyHeader, object_name: Literal["text_completion", "chat.completion.chunk"],
                usage: common_pb2.Usage) -> dict:
    """The last event of a stream with stream_options.include_usage."""
    return {**header.fields(object_name), "choices": [], "usage": usage_dict(usage)}


@dataclass(frozen=True)
class Reply:
    """One endpoint's reply to one request: the whole body, or the SSE events of a stream."""
    header: ReplyHeader
    chat: bool
    include_usage: bool = False
    return_token_ids: bool = False
    prompt_token_ids: list[int] | None = None   # sent only with return_token_ids

    def body(self, text: str, token_ids: list[int], finish_reason: int, usage: common_pb2.Usage) -> dict:
        build = chat_body if self.chat else completion_body
        return build(self.header, text, finish_reason, usage, *self._ids(token_ids, first=True))

    def opening_events(self) -> list[dict]:
        """Chat's first event: the assistant role with empty content (and the prompt ids)."""
        if not self.chat:
            return []
        delta = {"role": "assistant", "content": ""}
        return [chat_chunk(self.header, delta, 0, self.include_usage, prompt_token_ids=self._prompt_ids())]

    def chunk_event(self, response: generate_pb2.GenerateResponse, first: bool) -> dict:
        """The event of one generator response; completions put the prompt ids in the first one."""
        token_ids, prompt_token_ids = self._ids(list(response.token_ids), first and not self.chat)
        if self.chat:
            return chat_chunk(self.header, {"content": response.text}, response.finish_reason, self.include_usage,
                              token_ids)
        return completion_chunk(self.header, response.text, response.finish_reason, self.include_usage,
                                token_ids, prompt_token_ids)

    def closing_events(self, usage: common_pb2.Usage) -> list[dict]:
        if not self.include_usage:
            return []
        return [usage_chunk(self.header, "chat.completion.chunk" if self.chat else "text_completion", usage)]

    def _ids(self, token_ids: list[int], first: bool) -> tuple[list[int] | None, list[int] | None]:
        if not self.return_token_ids:
            return None, None
        return token_ids, self._prompt_ids() if first else None

    def _prompt_ids(self) -> list[int] | None:
        return self.prompt_token_ids if self.return_token_ids else None


def _with_ids(choice: dict, token_ids: list[int] | None, prompt_token_ids: list[int] | None = None) -> dict:
    if prompt_token_ids is not None:
        choice["prompt_token_ids"] = prompt_token_ids
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return choice


def _with_prompt_ids(body: dict, prompt_token_ids: list[int] | None) -> dict:
    return body if prompt_token_ids is None else {**body, "prompt_token_ids": prompt_token_ids}


def _with_null_usage(chunk: dict, include_usage: bool) -> dict:
    return {**chunk, "usage": None} if include_usage else chunk

"""OpenAI request bodies (pydantic), one model per endpoint, and their conversion to GenerateRequest
(the replies are in openai_replies.py)."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from gateway.chat_template import ChatTemplate
from pdmesh.errors import InvalidRequest
from pdmesh.validation import check_stop
from pdmesh.v1 import common_pb2, generate_pb2

COMPLETIONS_DEFAULT_MAX_TOKENS = 16   # OpenAI's default for /v1/completions
MAX_PROBLEMS_LISTED = 10   # of a body's validation errors, in the 400's message (a body can hold 100k errors)

# The proto's integer widths, checked here so an overflow is a 400, not a failed conversion.
Int32 = Annotated[int, Field(ge=-2**31, le=2**31 - 1)]
Int64 = Annotated[int, Field(ge=-2**63, le=2**63 - 1)]

class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool | None = False


class RequestSloBody(BaseModel):
    """{"ttft_s": 1.0, "tpot_s": 0.025}: a field left out is the tenant's or the gateway's."""
    model_config = ConfigDict(extra="forbid")
    ttft_s: float = Field(0.0, ge=0, allow_inf_nan=False)
    tpot_s: float = Field(0.0, ge=0, allow_inf_nan=False)


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
    slo: RequestSloBody | None = None   # pdmesh extension: the latency this request asks for
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

    @model_validator(mode="before")
    @classmethod
    def _let_the_gil_go(cls, data: Any) -> Any:
        """Python code per message: a thread validating a body of 100k messages hands the GIL to the event
        loop between two of them (pydantic-core alone holds it for the whole list, ~0.1 s per 4 MiB)."""
        return data

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
    check_stop(_stop_list(request.stop))
    return request


def _validation_message(exc: ValidationError) -> str:
    errors = exc.errors(include_url=False)
    problems = [f"{'.'.join(str(part) for part in error['loc']) or 'body'}: {error['msg']}"
                for error in errors[:MAX_PROBLEMS_LISTED]]
    more = f"; and {len(errors) - MAX_PROBLEMS_LISTED} more" if len(errors) > MAX_PROBLEMS_LISTED else ""
    return "invalid request: " + "; ".join(problems) + more


def completion_to_generate(body: CompletionRequest, request_id: str, max_tokens: int,
                           prompt_token_ids: list[int] | None = None) -> generate_pb2.GenerateRequest:
    """A text prompt travels as text (the mesh tokenizes it with special tokens), unless the caller
    has tokenized it already (`prompt_token_ids`); ids as ids. `max_tokens`: the body's, or the
    server's default where the body sets none (OpenAIHttpServer)."""
    request = _generate_request(body, request_id, max_tokens)
    prompt = body.single_prompt() if prompt_token_ids is None else prompt_token_ids
    if isinstance(prompt, str):
        request.text = prompt
    else:
        request.token_ids.ids.extend(prompt)
    return request


def chat_to_generate(body: ChatCompletionRequest, request_id: str, prompt_token_ids: list[int],
                     max_tokens: int) -> generate_pb2.GenerateRequest:
    """`prompt_token_ids`: the rendered chat (chat_prompt_text), tokenized; `max_tokens` as for
    completion_to_generate."""
    request = _generate_request(body, request_id, max_tokens)
    request.token_ids.ids.extend(prompt_token_ids)
    return request


def chat_prompt_text(body: ChatCompletionRequest, template: ChatTemplate) -> str:
    """The messages rendered by the chat template; tokenized without special tokens (the template
    writes them itself), as vLLM does for chat."""
    return template.render([m.template_dict() for m in body.messages], body.add_generation_prompt)


def _generate_request(body: _GenerationRequest, request_id: str, max_tokens: int) -> generate_pb2.GenerateRequest:
    sampling = common_pb2.SamplingParams(
        max_tokens=max_tokens, temperature=_or(body.temperature, 1.0), top_p=_or(body.top_p, 1.0),
        stop=_stop_list(body.stop), ignore_eos=body.ignore_eos)
    if body.seed is not None:
        sampling.seed = body.seed
    slo = generate_pb2.Slo(ttft_s=body.slo.ttft_s, tpot_s=body.slo.tpot_s) if body.slo else None
    return generate_pb2.GenerateRequest(request_id=request_id, model=body.model, sampling=sampling,
                                        cache_salt=body.cache_salt or "", slo=slo)


def _or(value: float | None, default: float) -> float:
    return default if value is None else value


def _stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)

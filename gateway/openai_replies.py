"""OpenAI reply bodies and stream events, one class per endpoint: /v1/completions (CompletionReply)
and /v1/chat/completions (ChatReply), each shaped as vLLM's OpenAI server answers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from pdmesh.v1 import common_pb2, generate_pb2

FINISH_REASONS = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_ABORT: "abort",
}


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


@dataclass(frozen=True)
class _Reply:
    """One request's reply: the whole body, or the SSE events of a stream."""
    header: ReplyHeader
    include_usage: bool = False
    return_token_ids: bool = False
    prompt_token_ids: list[int] | None = None   # sent only with return_token_ids

    chunk_object: ClassVar[str] = "text_completion"   # the "object" of a stream's events

    def closing_events(self, usage: common_pb2.Usage) -> list[dict]:
        """The last event of a stream with stream_options.include_usage."""
        if not self.include_usage:
            return []
        return [{**self.header.fields(self.chunk_object), "choices": [], "usage": usage_dict(usage)}]

    def _token_ids(self, token_ids: list[int]) -> list[int] | None:
        return token_ids if self.return_token_ids else None

    def _prompt_ids(self) -> list[int] | None:
        return self.prompt_token_ids if self.return_token_ids else None

    def _chunk(self, choice: dict) -> dict:
        chunk = {**self.header.fields(self.chunk_object), "choices": [choice]}
        return {**chunk, "usage": None} if self.include_usage else chunk


@dataclass(frozen=True)
class CompletionReply(_Reply):
    """/v1/completions: prompt ids (with return_token_ids) in the choice, in the first chunk of a stream."""

    def body(self, text: str, token_ids: list[int], finish_reason: int, usage: common_pb2.Usage) -> dict:
        choice = _with_ids(self._choice(text, finish_reason), self._token_ids(token_ids), self._prompt_ids())
        return {**self.header.fields("text_completion"), "choices": [choice], "usage": usage_dict(usage)}

    def opening_events(self) -> list[dict]:
        return []

    def chunk_event(self, response: generate_pb2.GenerateResponse, first: bool) -> dict:
        choice = _with_ids(self._choice(response.text, response.finish_reason),
                           self._token_ids(list(response.token_ids)), self._prompt_ids() if first else None)
        return self._chunk(choice)

    @staticmethod
    def _choice(text: str, finish_reason: int) -> dict:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason_name(finish_reason)}


@dataclass(frozen=True)
class ChatReply(_Reply):
    """/v1/chat/completions: prompt ids (with return_token_ids) at the top level, in the opening
    event of a stream (the assistant role with empty content)."""
    chunk_object: ClassVar[str] = "chat.completion.chunk"

    def body(self, text: str, token_ids: list[int], finish_reason: int, usage: common_pb2.Usage) -> dict:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": finish_reason_name(finish_reason)}
        body = {**self.header.fields("chat.completion"), "choices": [_with_ids(choice, self._token_ids(token_ids))],
                "usage": usage_dict(usage)}
        return _with_prompt_ids(body, self._prompt_ids())

    def opening_events(self) -> list[dict]:
        return [_with_prompt_ids(self._chunk(self._choice({"role": "assistant", "content": ""}, 0)),
                                 self._prompt_ids())]

    def chunk_event(self, response: generate_pb2.GenerateResponse, first: bool) -> dict:
        choice = _with_ids(self._choice({"content": response.text}, response.finish_reason),
                           self._token_ids(list(response.token_ids)))
        return self._chunk(choice)

    @staticmethod
    def _choice(delta: dict, finish_reason: int) -> dict:
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason_name(finish_reason)}


def _with_ids(choice: dict, token_ids: list[int] | None, prompt_token_ids: list[int] | None = None) -> dict:
    if prompt_token_ids is not None:
        choice["prompt_token_ids"] = prompt_token_ids
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return choice


def _with_prompt_ids(body: dict, prompt_token_ids: list[int] | None) -> dict:
    return body if prompt_token_ids is None else {**body, "prompt_token_ids": prompt_token_ids}


Reply = CompletionReply | ChatReply

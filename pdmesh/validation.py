"""Request checks shared by the gateway and the workers (a worker never trusts its caller)."""

from __future__ import annotations

import math
from collections.abc import Sequence

from pdmesh.errors import InvalidRequest
from pdmesh.v1 import common_pb2

MAX_TEMPERATURE = 2.0  # vLLM's bound
# Stop strings: OpenAI allows 4, TGI 4 by default (--max-stop-sequences), vLLM any number. Each is searched for
# in every new piece of text, so an unbounded list (100k strings) costs the engine on every token.
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 1024


def check_prompt(prompt_token_ids: Sequence[int], max_model_len: int, vocab_size: int) -> None:
    if not prompt_token_ids:
        raise InvalidRequest("prompt is empty")
    if len(prompt_token_ids) >= max_model_len:
        raise InvalidRequest(
            f"prompt has {len(prompt_token_ids)} tokens; the model's context is {max_model_len} tokens")
    bad = [t for t in prompt_token_ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequest(f"token ids {bad[:5]} outside the vocabulary [0, {vocab_size})")


def check_sampling(sampling: common_pb2.SamplingParams, num_prompt_tokens: int, max_model_len: int) -> None:
    if sampling.max_tokens <= 0:
        raise InvalidRequest(f"max_tokens must be > 0, got {sampling.max_tokens}")
    if num_prompt_tokens + sampling.max_tokens > max_model_len:
        raise InvalidRequest(
            f"prompt ({num_prompt_tokens} tokens) + max_tokens ({sampling.max_tokens}) exceeds the "
            f"model's context of {max_model_len} tokens")
    check_sampling_values(sampling)


def check_sampling_values(sampling: common_pb2.SamplingParams) -> None:
    """What vLLM's SamplingParams refuses, refused here first (it would fail inside the engine instead)."""
    if not (math.isfinite(sampling.temperature) and 0 <= sampling.temperature <= MAX_TEMPERATURE):
        raise InvalidRequest(f"temperature must be a finite number in [0, {MAX_TEMPERATURE}], got {sampling.temperature}")
    if not 0 <= sampling.top_p <= 1:  # NaN fails this too; 0 means 1.0
        raise InvalidRequest(f"top_p must be in (0, 1], got {sampling.top_p}")
    check_stop(sampling.stop)


def check_stop(stop: Sequence[str]) -> None:
    if len(stop) > MAX_STOP_STRINGS:
        raise InvalidRequest(f"stop has {len(stop)} strings; at most {MAX_STOP_STRINGS} are allowed")
    if any(not string for string in stop):
        raise InvalidRequest("stop cannot contain an empty string")
    longest = max(map(len, stop), default=0)
    if longest > MAX_STOP_CHARS:
        raise InvalidRequest(f"a stop string has {longest} characters; at most {MAX_STOP_CHARS} are allowed")


def check_transfer_id(transfer_id: str) -> None:
    """A layer-wise transfer id ("" when the flow is not layer-wise): an unguessable capability,
    as secrets.token_urlsafe mints them."""
    if not transfer_id:
        return
    if not 16 <= len(transfer_id) <= 64 or not all(c.isascii() and (c.isalnum() or c in "-_") for c in transfer_id):
        raise InvalidRequest("layerwise_transfer_id must be 16-64 URL-safe characters (an unguessable id)")

"""Proto sampling params to vLLM's (shared by both workers; vLLM is imported on call)."""

from __future__ import annotations

from typing import Any

from pdmesh.v1 import common_pb2

FINISH_REASONS = {
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "abort": common_pb2.FINISH_REASON_ABORT,
}


def finish_reason_of(vllm_reason: str | None) -> int:
    return FINISH_REASONS.get(vllm_reason or "", common_pb2.FINISH_REASON_UNSPECIFIED)


def to_vllm_sampling(sampling: common_pb2.SamplingParams, kv_transfer_params: dict[str, Any],
                     max_tokens: int | None = None):
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(
        max_tokens=sampling.max_tokens if max_tokens is None else max_tokens,
        temperature=sampling.temperature,
        top_p=sampling.top_p or 1.0,
        seed=sampling.seed if sampling.HasField("seed") else None,
        stop=list(sampling.stop) or None,
        ignore_eos=sampling.ignore_eos,
        output_kind=RequestOutputKind.DELTA,
        extra_args={"kv_transfer_params": kv_transfer_params},
    )


def engine_prompt(prompt_token_ids, cache_salt: str = "") -> dict[str, Any]:
    """vLLM's TokensPrompt; a cache salt keeps the request's KV apart from other salts' (tenants)."""
    prompt: dict[str, Any] = {"prompt_token_ids": list(prompt_token_ids)}
    if cache_salt:
        prompt["cache_salt"] = cache_salt
    return prompt

"""The gateway's sampling checks against the oracle they mirror: vLLM's own SamplingParams. Every value
vLLM refuses (it would fail inside the engine, after a prefill ran) is refused by check_sampling, and
nothing vLLM takes is refused."""

from __future__ import annotations

import itertools

import pytest

from pdmesh.errors import InvalidRequest
from pdmesh.sampling import to_vllm_sampling
from pdmesh.v1 import common_pb2
from pdmesh.validation import check_sampling

TEMPERATURES = [0.0, 0.5, 1.0, 2.0, 2.0001, 2.5, -0.0, -1e-9, -1.0, float("nan"), float("inf"), float("-inf")]
TOP_PS = [0.0, 1e-6, 0.5, 1.0, 1.0001, -0.5, float("nan"), float("inf")]
STOPS = [[], ["x"], ["x", "yz"], [""], ["x", ""]]
MAX_TOKENS = [1, 16, 0, -1]


def _vllm_refuses(sampling: common_pb2.SamplingParams) -> bool:
    from vllm.exceptions import VLLMValidationError

    try:
        to_vllm_sampling(sampling, kv_transfer_params={})
    except (VLLMValidationError, ValueError):
        return True
    return False


def _check_refuses(sampling: common_pb2.SamplingParams) -> bool:
    try:
        check_sampling(sampling, num_prompt_tokens=4, max_model_len=4096)
    except InvalidRequest:
        return True
    return False


@pytest.mark.parametrize("max_tokens", MAX_TOKENS)
def test_check_sampling_refuses_exactly_what_vllm_refuses(max_tokens):
    disagreements = []
    for temperature, top_p, stop in itertools.product(TEMPERATURES, TOP_PS, STOPS):
        sampling = common_pb2.SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, stop=stop)
        if _check_refuses(sampling) != _vllm_refuses(sampling):
            disagreements.append((temperature, top_p, stop))
    assert disagreements == []

"""Proto sampling params to vLLM's, with the connector's KV handle attached."""

from __future__ import annotations

from pdmesh.connector.params import decode_params
from pdmesh.v1 import common_pb2, worker_pb2

FINISH_REASONS = {
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "abort": common_pb2.FINISH_REASON_ABORT,
}


def to_vllm_sampling(request: worker_pb2.DecodeRequest, trace_carrier: dict[str, str] | None = None):
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    sampling = request.sampling
    return SamplingParams(
        max_tokens=sampling.max_tokens,
        temperature=sampling.temperature,
        top_p=sampling.top_p or 1.0,
        seed=sampling.seed if sampling.HasField("seed") else None,
        stop=list(sampling.stop) or None,
        ignore_eos=sampling.ignore_eos,
        output_kind=RequestOutputKind.DELTA,
        extra_args={"kv_transfer_params": decode_params(request.request_id, request.kv, trace_carrier)},
    )

"""Prefill service: runs the prompt with max_tokens=1 and returns the handle of its pinned KV."""

from __future__ import annotations

from pdmesh.connector.params import handle_from_params, prefill_params
from pdmesh.errors import InvalidRequest, WorkerFailed
from pdmesh.grpc_errors import maps_domain_errors
from pdmesh.validation import check_prompt
from pdmesh.v1 import worker_pb2, worker_pb2_grpc


class PrefillServicer(worker_pb2_grpc.PrefillServicer):
    def __init__(self, engine, info: worker_pb2.WorkerInfoResponse) -> None:
        self._engine = engine
        self._info = info

    @maps_domain_errors
    async def Prefill(self, request: worker_pb2.PrefillRequest, context) -> worker_pb2.PrefillResponse:
        from vllm import SamplingParams

        if not request.request_id:
            raise InvalidRequest("request_id is required")
        prompt_token_ids = list(request.prompt_token_ids)
        check_prompt(prompt_token_ids, self._info.max_model_len, self._info.vocab_size)
        sampling = SamplingParams(max_tokens=1, temperature=0.0,
                                  extra_args={"kv_transfer_params": prefill_params(request.request_id)})
        final = None
        async for output in self._engine.generate({"prompt_token_ids": prompt_token_ids}, sampling,
                                                  request_id=request.request_id):
            final = output
        if final is None or not final.kv_transfer_params:
            raise WorkerFailed(f"prefill of {request.request_id} produced no KV handle")
        num_cached = final.num_cached_tokens or 0
        return worker_pb2.PrefillResponse(
            request_id=request.request_id,
            kv=handle_from_params(final.kv_transfer_params, self._info.compat),
            num_computed_tokens=len(prompt_token_ids) - num_cached,
            num_cached_tokens=num_cached,
        )

"""Decode service: pulls the prompt's KV from prefill (via the connector) and streams tokens."""

from __future__ import annotations

from decode.sampling import FINISH_REASONS, to_vllm_sampling
from pdmesh.compat import check_compatible
from pdmesh.errors import InvalidRequest
from pdmesh.grpc_errors import maps_domain_errors
from pdmesh.validation import check_prompt, check_sampling
from pdmesh.v1 import common_pb2, worker_pb2, worker_pb2_grpc


class DecodeServicer(worker_pb2_grpc.DecodeServicer):
    def __init__(self, engine, info: worker_pb2.WorkerInfoResponse) -> None:
        self._engine = engine
        self._info = info

    @maps_domain_errors
    async def Decode(self, request: worker_pb2.DecodeRequest, context):
        self._check(request)
        prompt_token_ids = list(request.prompt_token_ids)
        async for output in self._engine.generate({"prompt_token_ids": prompt_token_ids},
                                                  to_vllm_sampling(request), request_id=request.request_id):
            completion = output.outputs[0]
            chunk = worker_pb2.DecodeResponse(token_ids=completion.token_ids, text=completion.text)
            if output.finished:
                await self._fill_final(chunk, request.request_id, completion.finish_reason)
            yield chunk

    def _check(self, request: worker_pb2.DecodeRequest) -> None:
        if not request.request_id:
            raise InvalidRequest("request_id is required")
        check_prompt(request.prompt_token_ids, self._info.max_model_len, self._info.vocab_size)
        check_sampling(request.sampling, len(request.prompt_token_ids), self._info.max_model_len)
        check_compatible(self._info.compat, request.kv.compat)
        if request.kv.num_tokens > len(request.prompt_token_ids):
            raise InvalidRequest("KV handle covers more tokens than the prompt has")

    async def _fill_final(self, chunk: worker_pb2.DecodeResponse, request_id: str, finish_reason: str | None) -> None:
        chunk.finish_reason = FINISH_REASONS.get(finish_reason or "", common_pb2.FINISH_REASON_UNSPECIFIED)
        stats = (await self._engine.collective_rpc("pdmesh_transfer_stats", args=(request_id,)))[0]
        if stats:
            chunk.kv_blocks_received = stats["num_blocks"]
            chunk.kv_bytes_received = stats["num_bytes"]
            chunk.kv_seconds = stats["seconds"]
            chunk.num_cached_tokens = stats["num_reused_tokens"]

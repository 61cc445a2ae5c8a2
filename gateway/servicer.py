"""Client-facing Generation service: tokenizes, validates, runs prefill then decode, streams tokens."""

from __future__ import annotations

import logging
import uuid

import grpc

from gateway.pool import Worker, WorkerPool
from gateway.tokenizer import PromptTokenizer
from pdmesh.errors import InvalidRequest, ModelNotFound
from pdmesh.grpc_errors import maps_domain_errors
from pdmesh.telemetry.metrics import MeshMetrics
from pdmesh.telemetry.observe import TokenTimer, observe_request
from pdmesh.telemetry.tracing import request_context, tracer
from pdmesh.validation import check_prompt, check_sampling
from pdmesh.v1 import common_pb2, generate_pb2, generate_pb2_grpc, worker_pb2, worker_pb2_grpc


logger = logging.getLogger(__name__)


class GenerationServicer(generate_pb2_grpc.GenerationServicer):
    def __init__(self, pool: WorkerPool, tokenizer: PromptTokenizer, request_timeout_s: float,
                 metrics: MeshMetrics, first_token_from: str = "decode") -> None:
        self._pool = pool
        self._tokenizer = tokenizer
        self._request_timeout_s = request_timeout_s
        self._metrics = metrics
        self._stream_prefill_token = first_token_from == "prefill"

    @maps_domain_errors
    async def Generate(self, request: generate_pb2.GenerateRequest, context):
        request_id = request.request_id or uuid.uuid4().hex
        with request_context(request_id), tracer().start_as_current_span("gateway.generate") as span, \
                observe_request(self._metrics):
            async for response in self._generate(request, request_id, span):
                yield response

    async def _generate(self, request: generate_pb2.GenerateRequest, request_id: str, span):
        prefill, decode = await self._pool.pick_pair()
        span.set_attributes({"pdmesh.route.policy": self._pool.policy, "pdmesh.route.prefill": prefill.address,
                             "pdmesh.route.decode": decode.address})
        prompt_token_ids = self._prompt_token_ids(request, decode.info)
        span.set_attribute("pdmesh.prompt_tokens", len(prompt_token_ids))
        prefilled = await worker_pb2_grpc.PrefillStub(prefill.channel).Prefill(worker_pb2.PrefillRequest(
            request_id=request_id, prompt_token_ids=prompt_token_ids,
            sampling=request.sampling if self._stream_prefill_token else None), timeout=self._request_timeout_s)
        timer = TokenTimer(self._metrics)
        num_completion_tokens = 0
        async for chunk in self._chunks(request, request_id, prompt_token_ids, prefilled, decode):
            num_completion_tokens += len(chunk.token_ids)
            timer.on_chunk(len(chunk.token_ids))
            yield self._response(request_id, chunk, prefill, decode, prefilled, len(prompt_token_ids),
                                 num_completion_tokens)
        span.set_attributes({"pdmesh.completion_tokens": num_completion_tokens, **timer.span_attributes()})
        logger.info("request finished: %d prompt + %d completion tokens via %s -> %s", len(prompt_token_ids),
                    num_completion_tokens, prefill.address, decode.address)

    async def _chunks(self, request: generate_pb2.GenerateRequest, request_id: str, prompt_token_ids: list[int],
                      prefilled: worker_pb2.PrefillResponse, decode: Worker):
        """Decode's stream; with first_token_from=prefill, prefill's token first and decode continuing
        from prompt + that token (no last-token recompute on decode, first token before the KV moves)."""
        decode_prompt, sampling = prompt_token_ids, request.sampling
        if self._stream_prefill_token:
            first = worker_pb2.DecodeResponse(token_ids=[prefilled.first_token_id], text=prefilled.first_text)
            if prefilled.finish_reason == common_pb2.FINISH_REASON_STOP or sampling.max_tokens == 1:
                first.finish_reason = prefilled.finish_reason
                await self._pool.release_kv(prefilled.kv)  # no decode will pull it
                yield first
                return
            yield first
            decode_prompt = [*prompt_token_ids, prefilled.first_token_id]
            sampling = common_pb2.SamplingParams()
            sampling.CopyFrom(request.sampling)
            sampling.max_tokens -= 1
        decode_request = worker_pb2.DecodeRequest(request_id=request_id, prompt_token_ids=decode_prompt,
                                                  sampling=sampling, kv=prefilled.kv)
        try:
            async for chunk in worker_pb2_grpc.DecodeStub(decode.channel).Decode(
                    decode_request, timeout=self._request_timeout_s):
                yield chunk
        except grpc.aio.AioRpcError:
            await self._pool.release_kv(prefilled.kv)  # decode may never have pulled; don't pin till timeout
            raise

    @maps_domain_errors
    async def ListModels(self, request, context):
        info = await self._pool.any_info()
        return generate_pb2.ListModelsResponse(
            models=[generate_pb2.ModelCard(id=info.model, max_model_len=info.max_model_len)])

    def _prompt_token_ids(self, request: generate_pb2.GenerateRequest,
                          info: worker_pb2.WorkerInfoResponse) -> list[int]:
        if request.model and request.model != info.model:
            raise ModelNotFound(f"model {request.model!r} is not served here; available: [{info.model!r}]")
        which = request.WhichOneof("prompt")
        if which is None:
            raise InvalidRequest("prompt is empty")
        prompt_token_ids = self._tokenizer.encode(request.text) if which == "text" else list(request.token_ids.ids)
        if which == "text" and not request.text:
            raise InvalidRequest("prompt is empty")
        check_prompt(prompt_token_ids, info.max_model_len, info.vocab_size)
        check_sampling(request.sampling, len(prompt_token_ids), info.max_model_len)
        return prompt_token_ids

    @staticmethod
    def _response(request_id: str, chunk: worker_pb2.DecodeResponse, prefill: Worker, decode: Worker,
                  prefilled: worker_pb2.PrefillResponse, num_prompt_tokens: int,
                  num_completion_tokens: int) -> generate_pb2.GenerateResponse:
        response = generate_pb2.GenerateResponse(request_id=request_id, token_ids=chunk.token_ids, text=chunk.text)
        if chunk.finish_reason:
            response.finish_reason = chunk.finish_reason
            response.usage.prompt_tokens = num_prompt_tokens
            response.usage.completion_tokens = num_completion_tokens
            response.usage.total_tokens = num_prompt_tokens + num_completion_tokens
            response.usage.cached_prompt_tokens = prefilled.num_cached_tokens
            response.transfer.prefill_computed_tokens = prefilled.num_computed_tokens
            response.transfer.prefill_cached_tokens = prefilled.num_cached_tokens
            response.transfer.prefill_store_tokens.update(prefilled.kv_store_tokens)
            response.transfer.num_blocks = chunk.kv_blocks_received
            response.transfer.num_bytes = chunk.kv_bytes_received
            response.transfer.seconds = chunk.kv_seconds
            response.transfer.first_block_seconds = chunk.kv_first_block_seconds
            response.transfer.num_cached_tokens = chunk.num_cached_tokens
            response.transfer.prefill_worker = prefill.address
            response.transfer.decode_worker = decode.address
        return response

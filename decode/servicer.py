"""Decode service: pulls the prompt's KV from prefill (via the connector) and streams tokens, one
call a request (Decode) or many requests over one call (DecodeStreams)."""

from __future__ import annotations

import logging
from contextlib import aclosing

from decode.decode_streams import DecodeStreamsCall
from pdmesh.compat import check_readable, tp_size
from pdmesh.errors import InvalidRequest
from pdmesh.grpc_errors import maps_domain_errors
from pdmesh.kv.params import DECODE_STEP_S, PREFILL_TOKENS_PER_S, decode_params
from pdmesh.kv.request_stats import PullStats, pull_stats
from pdmesh.sampling import engine_prompt, finish_reason_of, to_vllm_sampling
from pdmesh.telemetry.metrics import MeshMetrics
from pdmesh.telemetry.observe import TokenTimer, observe_request
from pdmesh.telemetry.tracing import inject_carrier, request_context, tracer
from pdmesh.v1 import worker_pb2, worker_pb2_grpc
from pdmesh.validation import check_prompt, check_sampling

logger = logging.getLogger(__name__)


class DecodeServicer(worker_pb2_grpc.DecodeServicer):
    def __init__(self, engine, info: worker_pb2.WorkerInfoResponse, metrics: MeshMetrics) -> None:
        self._engine = engine
        self._info = info
        self._metrics = metrics
        self._calls: set[DecodeStreamsCall] = set()

    def drain(self) -> None:
        """The worker is stopping: its DecodeStreams calls take no new stream and end with their last."""
        for call in self._calls:
            call.drain()

    @maps_domain_errors
    async def Decode(self, request: worker_pb2.DecodeRequest, context):
        async for chunk in self._decode(request):
            yield chunk

    async def DecodeStreams(self, request_iterator, context):
        """Many decodes over one call (decode/decode_streams.py)."""
        call = DecodeStreamsCall(self._decode)
        self._calls.add(call)
        try:
            async with aclosing(call.serve(request_iterator)) as messages:
                async for message in messages:
                    yield message
        finally:
            self._calls.discard(call)

    async def _decode(self, request: worker_pb2.DecodeRequest):
        with request_context(request.request_id), tracer().start_as_current_span("decode") as span, \
                observe_request(self._metrics):
            self._check(request)
            timer = TokenTimer(self._metrics)
            num_tokens = 0
            async for output in self._engine.generate(engine_prompt(request.prompt_token_ids, request.cache_salt),
                                                      self._sampling(request),
                                                      request_id=request.request_id):
                completion = output.outputs[0]
                chunk = worker_pb2.DecodeResponse(token_ids=completion.token_ids, text=completion.text)
                num_tokens += len(completion.token_ids)
                timer.on_chunk(len(completion.token_ids))
                if output.finished:
                    self._fill_final(chunk, request, completion.finish_reason, output.kv_transfer_params)
                    if not request.kv.transfer_id:  # local prefill: what vLLM's own prefix cache had
                        chunk.num_cached_tokens = output.num_cached_tokens or 0
                yield chunk
            span.set_attributes({"pdmesh.completion_tokens": num_tokens, **timer.span_attributes()})
            logger.info("decode finished: %d tokens, ttft %.3fs", num_tokens, timer.ttft_s or 0.0)

    @staticmethod
    def _sampling(request: worker_pb2.DecodeRequest):
        return to_vllm_sampling(request.sampling, decode_params(request.request_id, request.kv, inject_carrier()))

    def _check(self, request: worker_pb2.DecodeRequest) -> None:
        if not request.request_id:
            raise InvalidRequest("request_id is required")
        check_prompt(request.prompt_token_ids, self._info.max_model_len, self._info.vocab_size)
        check_sampling(request.sampling, len(request.prompt_token_ids), self._info.max_model_len)
        if request.kv.transfer_id:
            check_readable(request.kv.compat, self._info.compat)  # the producer may have more ranks
            if max(1, request.kv.tp_size) != tp_size(request.kv.compat):
                raise InvalidRequest(f"KV handle names {request.kv.tp_size} producer ranks, its compat "
                                     f"{tp_size(request.kv.compat)}")
        if request.kv.num_tokens > len(request.prompt_token_ids):
            raise InvalidRequest("KV handle covers more tokens than the prompt has")

    def _fill_final(self, chunk: worker_pb2.DecodeResponse, request: worker_pb2.DecodeRequest,
                    finish_reason: str | None, kv_params: dict | None) -> None:
        chunk.finish_reason = finish_reason_of(finish_reason)
        chunk.prefill_tokens_per_s = (kv_params or {}).get(PREFILL_TOKENS_PER_S, 0.0)
        chunk.decode_step_s = (kv_params or {}).get(DECODE_STEP_S, 0.0)
        stats = pull_stats(kv_params)  # what the KV pull did, returned with the output
        if stats:
            chunk.kv_blocks_received = stats.num_blocks
            chunk.kv_bytes_received = stats.num_bytes
            chunk.kv_seconds = stats.seconds
            chunk.kv_first_block_seconds = stats.first_block_seconds
            chunk.num_cached_tokens = stats.num_reused_tokens
            if stats.layerwise:
                chunk.kv_layerwise = True
                chunk.kv_seconds_before_prefill_done = stats.seconds_before_prefill_done
                chunk.kv_seconds_after_prefill_done = stats.seconds_after_prefill_done
                chunk.kv_overlap_ratio = stats.overlap_ratio
            self._record_transfer(stats, len(request.prompt_token_ids))

    def _record_transfer(self, stats: PullStats, num_prompt_tokens: int) -> None:
        role, m, transport = self._metrics.role, self._metrics, stats.transport or "none"
        m.kv_bytes.labels(role, "received", transport).inc(stats.num_bytes)
        m.kv_failed_blocks.labels(role).inc(stats.num_failed_blocks)
        if stats.num_bytes and stats.seconds > 0:
            m.kv_gbps.labels(role, transport).observe(stats.num_bytes / stats.seconds / 1e9)
            m.kv_seconds.labels(role, transport).observe(stats.seconds)
            if stats.layerwise:
                m.kv_overlap_ratio.labels(role, transport).observe(stats.overlap_ratio)
        m.cache_query_tokens.labels(role).inc(num_prompt_tokens)
        m.cache_hit_tokens.labels(role, "device").inc(stats.num_local_tokens)
        m.cache_hit_tokens.labels(role, "peer").inc(stats.num_reused_tokens - stats.num_local_tokens)

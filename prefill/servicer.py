"""Prefill service: runs the prompt with max_tokens=1 and returns the handle of its pinned KV."""

from __future__ import annotations

import asyncio
import logging

from pdmesh.background import BackgroundTasks
from pdmesh.errors import InvalidRequest, WorkerFailed
from pdmesh.grpc_errors import maps_domain_errors
from pdmesh.kv.params import KV_HANDLE, LOADED_FROM_STORE, PREFILL_TOKENS_PER_S, handle_from_params, prefill_params
from pdmesh.kv.request_stats import StoreLoadStats, store_load_stats
from pdmesh.sampling import engine_prompt, finish_reason_of, to_vllm_sampling
from pdmesh.telemetry.metrics import MeshMetrics
from pdmesh.telemetry.observe import TokenTimer, observe_request
from pdmesh.telemetry.tracing import inject_carrier, request_context, tracer
from pdmesh.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from pdmesh.validation import check_prompt, check_sampling_values, check_transfer_id
from prefill.used_transfer_ids import UsedTransferIds
from worker.vllm_ext.engine_calls import EngineCalls

logger = logging.getLogger(__name__)
GREEDY = common_pb2.SamplingParams(max_tokens=1, temperature=0.0)


class PrefillServicer(worker_pb2_grpc.PrefillServicer):
    def __init__(self, engine, info: worker_pb2.WorkerInfoResponse, metrics: MeshMetrics) -> None:
        self._engine = engine
        self._calls = EngineCalls(engine)
        self._info = info
        self._metrics = metrics
        self._background = BackgroundTasks()
        self._used_transfer_ids = UsedTransferIds()

    @maps_domain_errors
    async def Prefill(self, request: worker_pb2.PrefillRequest, context) -> worker_pb2.PrefillResponse:
        with request_context(request.request_id), tracer().start_as_current_span("prefill") as span, \
                observe_request(self._metrics):
            try:
                response = await self._prefill(request)
            except asyncio.CancelledError:
                self._release_soon(request.request_id)
                raise
            span.set_attributes({"pdmesh.tokens_computed": response.num_computed_tokens,
                                 "pdmesh.tokens_reused": response.num_cached_tokens,
                                 "pdmesh.kv_blocks": len(response.kv.block_ids),
                                 **{f"pdmesh.kvstore.tokens.{t}": n for t, n in response.kv_store_tokens.items()}})
            logger.info("prefill finished: %d tokens computed, %d cached (store: %s)", response.num_computed_tokens,
                        response.num_cached_tokens, dict(response.kv_store_tokens) or "-")
            return response

    async def _prefill(self, request: worker_pb2.PrefillRequest) -> worker_pb2.PrefillResponse:
        if not request.request_id:
            raise InvalidRequest("request_id is required")
        prompt_token_ids = list(request.prompt_token_ids)
        check_prompt(prompt_token_ids, self._info.max_model_len, self._info.vocab_size)
        # Greedy unless the gateway streams this token itself (then with the request's params).
        sampling = request.sampling if request.HasField("sampling") else GREEDY
        check_sampling_values(sampling)   # max_tokens aside: prefill runs one token
        check_transfer_id(request.layerwise_transfer_id)
        self._used_transfer_ids.claim(request.layerwise_transfer_id)
        params = prefill_params(request.request_id, inject_carrier(), request.layerwise_transfer_id)
        vllm_sampling = to_vllm_sampling(sampling, params, max_tokens=1)
        timer = TokenTimer(self._metrics)
        token_ids, pieces, final = [], [], None
        async for output in self._engine.generate(engine_prompt(prompt_token_ids, request.cache_salt), vllm_sampling,
                                                  request_id=request.request_id):
            completion = output.outputs[0]
            timer.on_chunk(len(completion.token_ids))
            token_ids += completion.token_ids
            pieces.append(completion.text)
            final = output
        if final is None or KV_HANDLE not in (final.kv_transfer_params or {}) or not token_ids:
            raise WorkerFailed(f"prefill of {request.request_id} produced no KV handle")
        stats = self._store_stats(final.kv_transfer_params)
        store_tokens = stats.tokens_by_tier if stats else {}
        # With a store load, vLLM's count includes tokens claimed from the store even when their
        # load failed and they were computed after all: count what really loaded instead.
        num_cached = (stats.num_local_tokens + sum(store_tokens.values()) if stats
                      else final.num_cached_tokens or 0)
        self._record_tokens(len(prompt_token_ids), num_cached, store_tokens)
        return worker_pb2.PrefillResponse(
            request_id=request.request_id,
            kv=handle_from_params(final.kv_transfer_params, self._info.compat),
            num_computed_tokens=len(prompt_token_ids) - num_cached,
            num_cached_tokens=num_cached,
            kv_store_tokens=store_tokens,
            first_token_id=token_ids[0],
            first_text="".join(pieces),
            finish_reason=finish_reason_of(final.outputs[0].finish_reason),
            prefill_tokens_per_s=final.kv_transfer_params.get(PREFILL_TOKENS_PER_S, 0.0),
        )

    @maps_domain_errors
    async def Release(self, request: worker_pb2.ReleaseKVRequest, context) -> worker_pb2.ReleaseKVResponse:
        if not request.transfer_id:
            raise InvalidRequest("transfer_id is required")
        released = await self._calls.release_transfer(request.transfer_id)
        return worker_pb2.ReleaseKVResponse(released=released)

    def _release_soon(self, request_id: str) -> None:
        """The caller went away: the engine may have finished the request and pinned its KV for a
        decode that will never come. Free it now (or as soon as the engine registers it)."""
        self._background.spawn(self._calls.release_request(request_id))

    @staticmethod
    def _store_stats(kv_params: dict) -> StoreLoadStats | None:
        """What the KV store loaded for this request, if it loaded anything: the connector returns
        it with the request's output."""
        if not kv_params.get(LOADED_FROM_STORE):
            return None
        return store_load_stats(kv_params)

    def _record_tokens(self, num_prompt_tokens: int, num_cached: int, store_tokens: dict[str, int]) -> None:
        role = self._metrics.role
        self._metrics.prefill_tokens.labels(role, "computed").inc(num_prompt_tokens - num_cached)
        self._metrics.prefill_tokens.labels(role, "cached").inc(num_cached)
        self._metrics.cache_query_tokens.labels(role).inc(num_prompt_tokens)
        # "device" is the engine's own prefix cache; the store's device tier is "store_device".
        self._metrics.cache_hit_tokens.labels(role, "device").inc(num_cached - sum(store_tokens.values()))
        for tier, num_tokens in store_tokens.items():
            self._metrics.cache_hit_tokens.labels(role, f"store_{tier}").inc(num_tokens)

"""The gateway's generation pipeline behind both APIs (gRPC and OpenAI HTTP): admission, limits,
tokenization, the tenant's cache salt, routing and failover (RequestRun), and the response stream.

The request id the workers and their engines see is minted here, unguessable, per request: engines
abort, and prefill workers free pinned KV, by that id, so an id a client chose could name another
tenant's request (a duplicate or a cancel with that id would free its KV). The client's
`request_id` is a label only: echoed in the responses, on the gateway's span and in its logs."""

from __future__ import annotations

import asyncio
import logging
import secrets
import uuid
from collections.abc import AsyncIterator

from gateway.admission import Admission
from gateway.cache_salt import CacheSalts, salt_key
from gateway.disagg import DisaggCosts, DisaggPolicy
from gateway.pool import WorkerPool
from gateway.request_run import RequestRun
from gateway.run_state import MeshRequest
from gateway.slo import request_slo
from gateway.routing import RoutePolicy
from gateway.tokenizer import PromptTokenizer
from pdmesh.config import GatewaySettings
from pdmesh.errors import InvalidRequest, ModelNotFound, PDMeshError
from pdmesh.telemetry.metrics import MeshMetrics
from pdmesh.telemetry.observe import TokenTimer, observe_request
from pdmesh.telemetry.tracing import request_context, tracer
from pdmesh.validation import check_prompt, check_sampling
from pdmesh.v1 import generate_pb2, worker_pb2

logger = logging.getLogger(__name__)
MAX_ID_PREFIX = 64   # characters of the client's request id kept in front of the engines' id


class MeshGenerator:
    def __init__(self, pool: WorkerPool, policy: RoutePolicy, tokenizer: PromptTokenizer, settings: GatewaySettings,
                 metrics: MeshMetrics) -> None:
        self._pool = pool
        self._policy = policy
        self._tokenizer = tokenizer
        self._settings = settings
        self._metrics = metrics
        self.disagg = DisaggPolicy(settings.disagg_policy,
                                   DisaggCosts(settings.disagg_initial_handoff_s),
                                   settings.max_local_stall_s)
        self.admission = Admission(settings.max_in_flight, settings.max_in_flight_per_tenant)
        self._salts = CacheSalts(salt_key(settings.salt_secret, settings.mesh_token))

    async def list_models(self) -> generate_pb2.ListModelsResponse:
        info = await self._pool.any_info()
        return generate_pb2.ListModelsResponse(
            models=[generate_pb2.ModelCard(id=info.model, max_model_len=info.max_model_len)])

    async def max_model_len(self) -> int:
        return (await self._pool.any_info()).max_model_len

    @property
    def max_tokens_limit(self) -> int | None:
        """The most tokens a request may ask for here (None: the context bounds them)."""
        return self._settings.max_tokens_limit

    async def stream(self, request: generate_pb2.GenerateRequest, tenant: str,
                     timeout_s: float | None = None) -> AsyncIterator[generate_pb2.GenerateResponse]:
        """The response chunks of one request; Overloaded at once when max_in_flight are running, or
        max_in_flight_per_tenant of the tenant's."""
        with self.admission.admit(tenant):
            client_request_id = request.request_id or uuid.uuid4().hex
            # the engines' id: the client's (a readable prefix, as vLLM suffixes a client's id) and 128 random
            # bits, so no client can name another's request
            mesh_request_id = f"{client_request_id[:MAX_ID_PREFIX]}-{secrets.token_hex(16)}"
            try:
                with request_context(mesh_request_id, client_request_id), \
                        tracer().start_as_current_span("gateway.generate") as span, observe_request(self._metrics):
                    async for response in self._generate(request, mesh_request_id, client_request_id, tenant,
                                                         timeout_s, span):
                        yield response
            except PDMeshError as exc:   # what the client is told; bad input included (a client's mistake)
                logger.warning("request %s (client's id %r) failed: %s: %s", mesh_request_id, client_request_id,
                               type(exc).__name__, exc)
                raise

    async def _generate(self, request: generate_pb2.GenerateRequest, mesh_request_id: str, client_request_id: str,
                        tenant: str, timeout_s: float | None, span):
        info = await self._pool.any_info()
        prompt_token_ids = await self._prompt_token_ids(request, info)
        mesh_request = MeshRequest(mesh_request_id, prompt_token_ids, request.sampling,
                                   self._salts.salt_of(tenant, request.cache_salt), client_request_id,
                                   request_slo(self._settings, tenant, request.slo))
        run = RequestRun(self._pool, self._policy, self.disagg, mesh_request, self._deadline(timeout_s),
                         self._settings.max_attempts, self._settings.first_token_from == "prefill",
                         layerwise=self._settings.kv_flow == "layerwise", decode_streams=self._settings.decode_streams)
        span.set_attributes({"pdmesh.route.policy": self._policy.name, "pdmesh.prompt_tokens": len(prompt_token_ids),
                             "pdmesh.tenant": tenant})
        timer = TokenTimer(self._metrics)
        async for response in run.responses():
            timer.on_chunk(len(response.token_ids))
            yield response
        self._count_placements(run)
        span.set_attributes({**run.span_attributes(), **timer.span_attributes()})
        logger.info("request finished (client's id %r): %d prompt + %d completion tokens, %d failovers",
                    client_request_id, len(prompt_token_ids), len(run.state.generated), run.state.num_failovers)

    def _count_placements(self, run: RequestRun) -> None:
        decision = run.state.decision
        self._metrics.disagg_decisions.labels("gateway", "local" if decision.local else "remote",
                                              decision.reason).inc()
        for local, num_tokens in run.state.placed:
            self._metrics.placed_prompt_tokens.labels("gateway", "local" if local else "remote").inc(num_tokens)
        if run.state.num_moves:
            self._metrics.streams_moved.labels("gateway").inc(run.state.num_moves)

    def _deadline(self, timeout_s: float | None) -> float:
        limit = self._settings.request_timeout_s if timeout_s is None else min(timeout_s,
                                                                                 self._settings.request_timeout_s)
        return asyncio.get_running_loop().time() + limit

    async def _prompt_token_ids(self, request: generate_pb2.GenerateRequest,
                                info: worker_pb2.WorkerInfoResponse) -> list[int]:
        if request.model and request.model != info.model:
            raise ModelNotFound(f"model {request.model!r} is not served here; available: [{info.model!r}]")
        which = request.WhichOneof("prompt")
        if which is None or (which == "text" and not request.text):
            raise InvalidRequest("prompt is empty")
        prompt_token_ids = (await self._tokenizer.encode_async(request.text, info.max_model_len) if which == "text"
                            else list(request.token_ids.ids))
        self._check_limits(len(prompt_token_ids), request.sampling.max_tokens)
        check_prompt(prompt_token_ids, info.max_model_len, info.vocab_size)
        check_sampling(request.sampling, len(prompt_token_ids), info.max_model_len)
        return prompt_token_ids

    def _check_limits(self, num_prompt_tokens: int, max_tokens: int) -> None:
        limit = self._settings.max_prompt_tokens
        if limit is not None and num_prompt_tokens > limit:
            raise InvalidRequest(f"prompt has {num_prompt_tokens} tokens; this gateway's limit is {limit}")
        limit = self._settings.max_tokens_limit
        if limit is not None and max_tokens > limit:
            raise InvalidRequest(f"max_tokens {max_tokens} is above this gateway's limit of {limit}")

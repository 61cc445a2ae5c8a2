"""Scheduler-side half of the connector (runs in vLLM's EngineCore process).

Producer (prefill): on finish, pins the request's blocks (delay free) and returns a handle
naming them. Consumer (decode): claims the prompt's tokens as externally computed, asks the
worker side to pull them asynchronously, and recomputes only the last prompt token.
Nothing here waits on the network: the store lookup answers "not yet" until its thread is done,
and what each request's pull or load did comes back with the worker's step output.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from pdmesh.kv.block_hash import salt_extra_key
from kvstore.store_lookup import AsyncStoreLookup
from pdmesh.kv import params as kvp
from pdmesh.kv.tasks import RecvTask, SendTask, StoreLoadTask
from worker.compute_rate import DEFAULT_TOKENS_PER_S, ComputeRate, LoadBudget
from worker.layerwise_steps import LayerwiseSteps
from worker.metadata import PDMeshConnectorMetadata, PDMeshWorkerMeta
from worker.prompt_hashes import PromptHashes
from worker.step_time import DecodeStepTime, num_decodes

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _salt(request: "Request") -> bytes:
    return salt_extra_key(getattr(request, "cache_salt", None) or "")


class ConnectorScheduler:
    def __init__(self, block_size: int, kv_address: str, block_seed: bytes,
                 store_lookup: AsyncStoreLookup | None = None, max_stats: int = 10_000, tp_size: int = 1,
                 compute_rate: ComputeRate | None = None, load_budget: LoadBudget | None = None) -> None:
        """block_seed: the model fingerprint's (pdmesh/compat.py), as the worker side's CompatInfo names it."""
        self._block_size = block_size
        self.compute_rate = compute_rate or ComputeRate(DEFAULT_TOKENS_PER_S)   # measured on the steps scheduled here
        self.decode_step_time = DecodeStepTime()   # the TPOT its streams see, measured on the same steps
        self._load_budget = load_budget or LoadBudget()
        self._hashes = PromptHashes(block_seed, block_size)
        self._kv_address = kv_address
        self._tp_size = tp_size  # this engine's tensor-parallel ranks (a producer's handles say it)
        self._store = store_lookup
        self._store_plans: dict[str, list[str]] = {}  # request id: node of each cached block
        self._store_loaded: set[str] = set()          # request ids that loaded from the store
        self._sends: list[SendTask] = []
        self._recvs: list[RecvTask] = []
        self._loads: list[StoreLoadTask] = []
        self._stats: OrderedDict[str, dict] = OrderedDict()  # request id: what its pull or load did
        self._max_stats = max_stats
        self._layerwise = LayerwiseSteps()  # producer: prompts a consumer reads layer by layer as they compute
        # producer, pull flow: the transfer id of each request, minted when first scheduled (engine request id: id)
        self._transfer_ids: dict[str, str] = {}
        self._minted: list[str] = []   # minted since the last metadata: the workers are told before any leaves
        self._unheld: list[str] = []   # minted ids whose requests ended without a hand-over

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        params = request.kv_transfer_params
        if params and params.get(kvp.DO_REMOTE_PREFILL):
            return self._num_remote_prefill_tokens(request, params, num_computed_tokens)
        return self._num_store_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if params and params.get(kvp.DO_REMOTE_PREFILL):
            self._plan_pull(request, params, blocks, num_external_tokens)
            return
        if params and params.get(kvp.DO_REMOTE_DECODE) and not params.get(kvp.LAYERWISE_TRANSFER_ID):
            self._mint_transfer_id(request.request_id)
        if params and params.get(kvp.LAYERWISE_TRANSFER_ID):
            self._layerwise.track(request.request_id, str(params[kvp.LAYERWISE_TRANSFER_ID]),
                                  params.get(kvp.PDMESH_REQUEST_ID, request.request_id),
                                  request.num_prompt_tokens, self._prompt_hashes(request))
        self._plan_store_load(request, blocks, num_external_tokens)

    def _mint_transfer_id(self, request_id: str) -> None:
        """The capability decode will read and free the request's blocks with, minted when it is first
        scheduled (kept across preemptions): the workers learn it with this step, before any output of
        the request, so a read that reaches the producer before the hold is known to be genuine."""
        if request_id not in self._transfer_ids:
            self._transfer_ids[request_id] = secrets.token_urlsafe(18)
            self._minted.append(self._transfer_ids[request_id])

    # ---- producer with a KV store ----
    def _num_store_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        if self._store is None or request.request_id in self._store_loaded:
            return 0, False  # one load per request: after a failed one, vLLM recomputes
        nodes = self._store_plans.get(request.request_id)
        if nodes is None:  # asked again while the request waits for room: reuse the answer
            nodes = self._store.poll(request.request_id, request.prompt_token_ids, self._prompt_hashes(request))
            if nodes is None:
                return None, False  # not yet: vLLM skips the request this step and asks again
            self._store_plans[request.request_id] = nodes
        count = len(nodes) * self._block_size - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def _plan_store_load(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        nodes = self._store_plans.pop(request.request_id, None)
        if not nodes or num_external_tokens <= 0:
            return
        num_cached_tokens = len(nodes) * self._block_size
        first = (num_cached_tokens - num_external_tokens) // self._block_size
        block_indexes = list(range(first, len(nodes)))
        local_block_ids = blocks.get_block_ids()[0]
        params = request.kv_transfer_params or {}
        self._store_loaded.add(request.request_id)
        self._loads.append(StoreLoadTask(
            request_id=request.request_id,
            pdmesh_request_id=params.get(kvp.PDMESH_REQUEST_ID, request.request_id),
            token_ids=list(request.prompt_token_ids[:num_cached_tokens]),
            extra_key=_salt(request),
            block_hashes=self._prompt_hashes(request, num_cached_tokens),
            block_indexes=block_indexes,
            local_block_ids=[local_block_ids[i] for i in block_indexes],
            nodes=[nodes[i] for i in block_indexes],
            budget_s=self._load_budget.seconds(self.compute_rate, len(block_indexes) * self._block_size),
            num_local_tokens=num_cached_tokens - num_external_tokens,
            trace_carrier=dict(params.get(kvp.TRACE_CARRIER) or {}),
        ))

    # ---- consumer ----
    def _num_remote_prefill_tokens(self, request: "Request", params: dict[str, Any],
                                   num_computed_tokens: int) -> tuple[int, bool]:
        handle = kvp.KVHandle.from_params(params)
        num_remote_tokens = min(handle.num_tokens, request.num_prompt_tokens)
        if not handle.layerwise and len(handle.block_ids) < _cdiv(num_remote_tokens, self._block_size):
            logger.warning("request %s: handle names too few blocks; recomputing", request.request_id)
            return 0, False
        count = num_remote_tokens - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def _plan_pull(self, request: "Request", params: dict[str, Any], blocks: "KVCacheBlocks",
                   num_external_tokens: int) -> None:
        params[kvp.DO_REMOTE_PREFILL] = False  # one transfer per request
        if num_external_tokens == 0:
            self._recvs.append(self._release_only(request, params))
            return
        handle = kvp.KVHandle.from_params(params)
        num_remote_tokens = min(handle.num_tokens, request.num_prompt_tokens)
        num_local_tokens = num_remote_tokens - num_external_tokens
        block_indexes = list(range(num_local_tokens // self._block_size,
                                   _cdiv(num_remote_tokens, self._block_size)))
        local_block_ids = blocks.get_block_ids()[0]
        self._recvs.append(RecvTask(
            request_id=request.request_id,
            pdmesh_request_id=params.get(kvp.PDMESH_REQUEST_ID, request.request_id),
            transfer_id=handle.transfer_id,
            kv_address=handle.kv_address,
            block_indexes=block_indexes,
            local_block_ids=[local_block_ids[i] for i in block_indexes],
            token_ids=list(request.prompt_token_ids[:num_remote_tokens]),
            block_hashes=self._prompt_hashes(request, num_remote_tokens),
            num_local_tokens=num_local_tokens,
            extra_key=_salt(request),
            trace_carrier=dict(params.get(kvp.TRACE_CARRIER) or {}),
            producer_tp_size=handle.tp_size,
            layerwise=handle.layerwise,
        ))

    # ---- both: per-request stats from the worker side ----
    def update_connector_output(self, worker_meta: Any) -> None:
        if not isinstance(worker_meta, PDMeshWorkerMeta):
            return
        self._stats.update(worker_meta.stats)
        while len(self._stats) > self._max_stats:  # a request that left before its stats came
            self._stats.popitem(last=False)

    # ---- producer ----
    def request_finished(self, request: "Request", block_ids: Any) -> tuple[bool, dict[str, Any]]:
        """Every finished request's params carry the engine's measured prompt rate and decoding step time
        (the gateways read them)."""
        try:
            delay_free, params = self._request_finished(request, block_ids)
        finally:
            self._hashes.forget(request.request_id)
        return delay_free, {**(params or {}), kvp.PREFILL_TOKENS_PER_S: self.compute_rate.tokens_per_s,
                            kvp.DECODE_STEP_S: self.decode_step_time.step_s}

    def _request_finished(self, request: "Request", block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        self._store_plans.pop(request.request_id, None)
        if self._store is not None:
            self._store.forget(request.request_id)
        loaded_from_store = request.request_id in self._store_loaded
        self._store_loaded.discard(request.request_id)
        stats = self._stats.pop(request.request_id, None)
        stats_params = {kvp.REQUEST_STATS: stats} if stats is not None else None
        params = request.kv_transfer_params
        if not params:
            return False, stats_params
        if params.get(kvp.DO_REMOTE_PREFILL):
            # Consumer request aborted before its blocks were allocated: still free the producer's.
            params[kvp.DO_REMOTE_PREFILL] = False
            self._recvs.append(self._release_only(request, params))
            return False, stats_params
        layerwise_transfer_id = str(params.get(kvp.LAYERWISE_TRANSFER_ID) or "")
        minted = self._transfer_ids.pop(request.request_id, None)
        block_ids = list(block_ids[0]) if block_ids and isinstance(block_ids[0], (list, tuple)) else list(block_ids)
        handed_over = bool(params.get(kvp.DO_REMOTE_DECODE)) and self._finished_normally(request)
        if layerwise_transfer_id:
            self._layerwise.finish(request.request_id, layerwise_transfer_id, held=handed_over and bool(block_ids))
        if minted is not None and not (handed_over and block_ids):
            self._unheld.append(minted)
        if not handed_over:
            return False, stats_params
        if not block_ids:
            return False, None
        num_tokens = request.num_computed_tokens
        block_ids = block_ids[:_cdiv(num_tokens, self._block_size)]
        # the capability decode reads and frees the blocks with (layer-wise: the one it already has)
        transfer_id = layerwise_transfer_id or minted or secrets.token_urlsafe(18)
        self._sends.append(SendTask(transfer_id, block_ids, list(request.prompt_token_ids[:num_tokens]),
                                    extra_key=_salt(request),
                                    pdmesh_request_id=params.get(kvp.PDMESH_REQUEST_ID, request.request_id),
                                    trace_carrier=dict(params.get(kvp.TRACE_CARRIER) or {}),
                                    engine_request_id=request.request_id,
                                    block_hashes=self._prompt_hashes(request, num_tokens)))
        handle = kvp.handle_params(kvp.KVHandle(transfer_id, self._kv_address, tuple(block_ids), num_tokens,
                                                self._tp_size))
        handle[kvp.LOADED_FROM_STORE] = loaded_from_store
        if stats is not None:
            handle[kvp.REQUEST_STATS] = stats
        return True, handle

    # ---- both ----
    def _prompt_hashes(self, request: "Request", num_tokens: int | None = None) -> list[bytes]:
        """The names of the blocks holding the prompt's first num_tokens tokens (hashed once per request)."""
        return self._hashes.of(request.request_id, request.prompt_token_ids, _salt(request), num_tokens)

    def has_work_for_workers(self) -> bool:
        """The next step's metadata would tell the workers something."""
        news = self._sends or self._recvs or self._loads or self._minted or self._unheld
        return bool(news) or self._layerwise.has_news()

    def build_connector_meta(self, scheduler_output: Any = None) -> PDMeshConnectorMetadata:
        """Once per engine step, as it is scheduled (the steps time the prompt rate and the decoding steps)."""
        if scheduler_output is not None:
            now = time.perf_counter()
            self.compute_rate.on_step(scheduler_output.total_num_scheduled_tokens, now)
            self.decode_step_time.on_step(num_decodes(scheduler_output), now)
        steps, restarted, ended = self._layerwise.take(scheduler_output)
        meta = PDMeshConnectorMetadata(
            sends=self._sends, recvs=self._recvs, loads=self._loads,
            layerwise_steps=steps, layerwise_restarted=restarted, layerwise_ended=ended,
            minted_transfer_ids=self._minted, unheld_transfer_ids=self._unheld)
        self._sends, self._recvs, self._loads, self._minted, self._unheld = [], [], [], [], []
        return meta

    def close(self) -> None:
        if self._store is not None:
            self._store.close()

    @staticmethod
    def _finished_normally(request: "Request") -> bool:
        from vllm.v1.request import RequestStatus

        return request.status in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)

    @staticmethod
    def _release_only(request: "Request", params: dict[str, Any]) -> RecvTask:
        handle = kvp.KVHandle.from_params(params)
        return RecvTask(
            request_id=request.request_id,
            pdmesh_request_id=params.get(kvp.PDMESH_REQUEST_ID, request.request_id),
            transfer_id=handle.transfer_id, kv_address=handle.kv_address,
            block_indexes=[], local_block_ids=[], token_ids=[], report_done=False, producer_tp_size=handle.tp_size)

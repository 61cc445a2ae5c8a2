"""A request as the gateway runs it: what the client asked (MeshRequest), what it got so far across
attempts (RunState), and the messages the client sees of it."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from gateway.disagg import Decision
from gateway.pool import Worker
from gateway.slo import RequestSlo
from pdmesh.v1 import common_pb2, generate_pb2, worker_pb2

# The final answer's TransferStats: its fields from decode's last message, and from the run's state.
TRANSFER_FROM_CHUNK = {"num_blocks": "kv_blocks_received", "num_bytes": "kv_bytes_received", "seconds": "kv_seconds",
                       "first_block_seconds": "kv_first_block_seconds", "num_cached_tokens": "num_cached_tokens",
                       "layerwise": "kv_layerwise", "seconds_before_prefill_done": "kv_seconds_before_prefill_done",
                       "seconds_after_prefill_done": "kv_seconds_after_prefill_done",
                       "overlap_ratio": "kv_overlap_ratio"}
TRANSFER_FROM_STATE = ("prefill_computed_tokens", "prefill_cached_tokens", "num_failovers", "resumed_at_token",
                       "prefill_seconds", "handoff_seconds", "num_moves")


@dataclass(frozen=True)
class MeshRequest:
    """What the client asked, validated and tokenized (generation.py makes it, nothing changes it)."""

    request_id: str          # minted by the gateway: the id every worker and engine sees
    prompt_token_ids: list[int]
    sampling: common_pb2.SamplingParams
    cache_salt: str
    client_request_id: str   # the id the client chose: a label, echoed back, never sent to a worker
    slo: RequestSlo = RequestSlo(2.5, 0.0)


@dataclass
class RunState:
    """What the request got so far, across attempts: owned by its RequestRun."""

    generated: list[int] = field(default_factory=list)
    num_failovers: int = 0
    num_moves: int = 0                # to another worker, off a prompt's compute (gateway/flows.py)
    resumed_at_token: int = 0
    first_prefill: worker_pb2.PrefillResponse | None = None
    prefill_computed_tokens: int = 0
    prefill_cached_tokens: int = 0
    prefill_store_tokens: Counter = field(default_factory=Counter)
    prefill: Worker | None = None     # of the latest attempt (None when it prefilled locally)
    decode: Worker | None = None
    decision: Decision | None = None  # of the latest attempt: remote or local prefill, and why
    prefill_seconds: float = 0.0      # the latest attempt's Prefill call, sent to answered
    handoff_seconds: float = 0.0      # from that answer to decode's first token (< 0: the token came first)
    placed: list[tuple[bool, int]] = field(default_factory=list)   # each attempt's (local, prompt tokens)

    def record_prefill(self, response: worker_pb2.PrefillResponse) -> None:
        self.first_prefill = self.first_prefill or response
        self.prefill_computed_tokens += response.num_computed_tokens
        self.prefill_cached_tokens += response.num_cached_tokens
        self.prefill_store_tokens.update(dict(response.kv_store_tokens))


def response_of(request: MeshRequest, state: RunState,
                chunk: worker_pb2.DecodeResponse) -> generate_pb2.GenerateResponse:
    """What the client sees of one of decode's messages; the last one also carries the usage and how
    the request's KV travelled, across attempts."""
    response = generate_pb2.GenerateResponse(request_id=request.client_request_id,
                                             token_ids=chunk.token_ids, text=chunk.text)
    if not chunk.finish_reason:
        return response
    num_prompt, num_completion = len(request.prompt_token_ids), len(state.generated)
    response.finish_reason = chunk.finish_reason
    response.usage.prompt_tokens = num_prompt
    response.usage.completion_tokens = num_completion
    response.usage.total_tokens = num_prompt + num_completion
    response.usage.cached_prompt_tokens = (state.first_prefill.num_cached_tokens if state.first_prefill
                                           else chunk.num_cached_tokens)
    transfer = response.transfer
    for name, chunk_field in TRANSFER_FROM_CHUNK.items():   # what decode's KV read did
        setattr(transfer, name, getattr(chunk, chunk_field))
    for name in TRANSFER_FROM_STATE:                        # what the run saw, across attempts
        setattr(transfer, name, getattr(state, name))
    transfer.prefill_store_tokens.update(state.prefill_store_tokens)
    transfer.prefill_worker = state.prefill.address if state.prefill else ""
    transfer.decode_worker = state.decode.address if state.decode else ""
    transfer.local_prefill = bool(state.decision and state.decision.local)
    return response


"""What became of one request: the monolithic tokens, a clear failure, a hang, or wrong output."""

from __future__ import annotations

import enum
import math
from collections import Counter
from dataclasses import dataclass

import grpc


class Outcome(str, enum.Enum):
    COMPLETED = "completed"            # every token equal to monolithic vLLM's
    FAILED_CLEAR = "failed_clear"      # a status a client can act on, with a message; tokens so far right
    FAILED_UNCLEAR = "failed_unclear"  # UNKNOWN or INTERNAL (a bug, not the fault), or no message
    HUNG = "hung"                      # no answer within the campaign's hang limit
    WRONG = "wrong"                    # a token differs from monolithic vLLM's, or the stream ended short


GOOD = (Outcome.COMPLETED, Outcome.FAILED_CLEAR)


@dataclass(frozen=True)
class RequestResult:
    prompt_index: int
    started_s: float          # time.monotonic()
    ended_s: float
    outcome: Outcome
    detail: str = ""          # the status and message, or where the tokens went wrong
    probe: bool = False       # sent by the load's tenant-isolation probe (load.py)
    prefill_cached_tokens: int = 0   # prompt tokens its prefill did not compute (prefix cache, KV store)
    num_failovers: int = 0
    request_id: str = ""      # the id the load sent (the mesh's logs name it)
    # The gateway's route on the last message (the latest attempt's workers, as it dials them): "" for
    # a request that never got its last message (failed, hung); remote_store_tokens: prompt tokens
    # its prefill fetched from another node's KV store.
    prefill_worker: str = ""
    decode_worker: str = ""
    remote_store_tokens: int = 0


def classify(tokens: list[int], expected: list[int], error: grpc.aio.AioRpcError | None = None,
             hung: bool = False) -> tuple[Outcome, str]:
    """tokens: what the stream delivered; expected: monolithic vLLM's tokens for the prompt."""
    if tokens != expected[:len(tokens)]:
        first = next((i for i, (got, want) in enumerate(zip(tokens, expected)) if got != want), len(expected))
        return Outcome.WRONG, f"token {first} of {len(tokens)} differs"
    if hung:
        return Outcome.HUNG, f"no end after {len(tokens)} tokens"
    if error is not None:
        code, message = error.code(), (error.details() or "").strip()
        detail = f"{code.name}: {message}"
        if code in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.OK) or not message:
            return Outcome.FAILED_UNCLEAR, detail
        return Outcome.FAILED_CLEAR, detail
    if len(tokens) != len(expected):
        return Outcome.WRONG, f"stream ended after {len(tokens)} of {len(expected)} tokens"
    return Outcome.COMPLETED, ""


def not_completed(results: list[RequestResult], most: int = 10) -> dict[str, int]:
    """The most frequent outcomes other than completed, with their details: how many each."""
    details = Counter(f"{r.outcome.value}: {r.detail}" for r in results if r.outcome != Outcome.COMPLETED)
    return dict(details.most_common(most))


def cross_tenant_hits(results: list[RequestResult]) -> tuple[int, int]:
    """(probe requests judged, those whose prefill reused cached tokens: another tenant's KV). A
    probe is judged when it completed without a failover (a retry may reuse its own first try's KV)."""
    judged = [r for r in results if r.probe and r.outcome == Outcome.COMPLETED and not r.num_failovers]
    return len(judged), sum(1 for r in judged if r.prefill_cached_tokens > 0)


def longest_silence(results: list[RequestResult]) -> tuple[float, float]:
    """(seconds, monotonic start) of the longest stretch in which requests were in flight but none
    ended: a stall of the mesh or of the machine. A pause of the load (nothing in flight) is none."""
    ordered = sorted(results, key=lambda r: r.ended_s)
    longest, earliest_start = (0.0, 0.0), math.inf   # earliest start among the requests ending later
    for before, after in reversed(list(zip(ordered, ordered[1:]))):
        earliest_start = min(earliest_start, after.started_s)
        begin = max(before.ended_s, earliest_start)
        longest = max(longest, (after.ended_s - begin, begin))
    return longest


def tally(results: list[RequestResult]) -> dict[str, int]:
    counts = Counter(result.outcome for result in results)
    return {outcome.value: counts.get(outcome, 0) for outcome in Outcome}

"""Conditional disaggregation: per request, prefill on a prefill worker (remote) or let the decode
worker compute the prompt itself (local), from costs this gateway measures.

NVIDIA Dynamo's router has the same switch (`--router-conditional-disagg`, experimental): short or
mostly cached prompts gain nothing from moving KV, and a prefill queue can cost more than computing
locally. The model, in seconds until the request's first token:

  remote = (tokens queued on the prefill worker + the prompt's tokens prefill must compute) / prefill
           rate + handoff (prefill's response to decode's first token: KV pull, scheduling)
  local  = (tokens queued for local prefill on the decode worker + the prompt's tokens decode must
           compute) / decode's prefill rate
  stall  = the tokens decode must compute / decode's prefill rate: how long every stream running on
           that decode waits while it computes the prompt (their inter-token latency)

"Must compute" is the effective input length: the prompt minus the prefix that worker's prefix
cache likely holds, estimated from the prompts this gateway sent it under the same cache salt (the
engines' caches are salted alike; gateway/seen_prefixes.py). A mostly cached prompt is cheap on
whichever side holds it.

Local wins when it is cheaper AND either the decode is idle or the stall stays within
`max_local_stall_s`. Each worker's prompt rate is the one its engine measures on its own steps and
publishes (worker/compute_rate.py: in every answer and in its registry record); until both workers
of a pair have published one, the prompt goes remote. The handoff is what this gateway observes
(an exponential moving average of remote handoffs, from `initial_handoff_s`). Queued tokens are this
gateway's own in-flight prompts on each worker.

Policies: "remote" (always disaggregate: vLLM's and SGLang's P/D flow), "local" (never: the decode
worker serves alone, a colocated baseline behind the same gateway), "conditional" (the model above).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Protocol

from gateway.flows import Flows
from gateway.prompt_names import PromptNames
from gateway.seen_prefixes import SeenPrefixes
from pdmesh.ewma import Ewma
from pdmesh.v1 import worker_pb2


@dataclass(frozen=True)
class Decision:
    local: bool
    # "policy", "cheaper_local", "cheaper_remote", "stall", "unmeasured", "one_worker"; adaptive (placement.py):
    # "soonest", "least_harm", "past_slo", "move"
    reason: str
    remote_s: float = 0.0
    local_s: float = 0.0
    stall_s: float = 0.0
    prefill_cached_tokens: int = 0   # the prompt's prefix the prefill worker likely has cached
    decode_cached_tokens: int = 0    # and the decode worker
    tpot_s: float = 0.0              # adaptive: the mean TPOT of the streams on the decode worker chosen

    def span_attributes(self) -> dict:
        return {"pdmesh.disagg.decision": "local" if self.local else "remote", "pdmesh.disagg.reason": self.reason,
                "pdmesh.disagg.remote_s": self.remote_s, "pdmesh.disagg.local_s": self.local_s,
                "pdmesh.disagg.stall_s": self.stall_s,
                "pdmesh.disagg.prefill_cached_tokens": self.prefill_cached_tokens,
                "pdmesh.disagg.decode_cached_tokens": self.decode_cached_tokens, "pdmesh.disagg.tpot_s": self.tpot_s}


class RatedWorker(Protocol):
    address: str
    info: worker_pb2.WorkerInfoResponse   # its model's CompatInfo names the prompt's blocks
    prefill_tokens_per_s: float   # its engine's published prompt rate (0: not known yet)

    def queue(self) -> int:
        """Requests it serves now (gateway/pool.py's Worker)."""

    def tpot_s(self) -> float:
        """The TPOT its streams see now, as it publishes it (0: serves none, or not known yet)."""


class QueuedWork:
    """Prompt tokens this gateway has a worker computing: counted from `DisaggCosts.enqueue` until
    `done` (idempotent), so every way out of a call ends the count once."""

    def __init__(self, queued_tokens: Counter, address: str, num_tokens: int) -> None:
        self._queued_tokens, self._address, self._num_tokens = queued_tokens, address, num_tokens
        queued_tokens[address] += num_tokens
        self.pending = True

    def done(self) -> None:
        if self.pending:
            self.pending = False
            self._queued_tokens[self._address] -= self._num_tokens


class DisaggCosts:
    """What the gateway has measured, and the work it has queued on each worker (by address)."""

    def __init__(self, initial_handoff_s: float) -> None:
        self.handoff_s = Ewma(initial_handoff_s)
        self.queued_tokens: Counter[str] = Counter()   # worker address: prompt tokens it is computing for us

    def enqueue(self, address: str, num_tokens: int) -> QueuedWork:
        """`num_tokens` of prompt now being computed on `address` for this gateway, until done()."""
        return QueuedWork(self.queued_tokens, address, num_tokens)

    def observe_handoff(self, seconds: float) -> None:
        if seconds > 0:
            self.handoff_s.observe(seconds)


class DisaggPolicy:
    def __init__(self, name: str, costs: DisaggCosts, max_local_stall_s: float,
                 seen: SeenPrefixes | None = None) -> None:
        self.name = name
        self.costs = costs
        self.seen = seen or SeenPrefixes()
        self._max_local_stall_s = max_local_stall_s
        self.decisions: Counter[tuple[bool, str]] = Counter()
        self.flows = Flows()   # adaptive: the live streams, and those asked to move

    @property
    def adaptive(self) -> bool:
        """Placement weighs every worker and pair (gateway/placement.py), not one pair routing chose."""
        return self.name == "adaptive"

    def count(self, decision: Decision) -> Decision:
        self.decisions[(decision.local, decision.reason)] += 1
        return decision

    def decide(self, prompt: PromptNames, prefill: RatedWorker, decode: RatedWorker, decode_busy: bool) -> Decision:
        """Where this request's prompt is computed; remembers which workers now hold it (under its salt)."""
        if decode is prefill:   # a worker taking both roles with no other to pair with: it serves whole
            decision = Decision(local=True, reason="one_worker")
        elif self.name != "conditional":
            decision = Decision(local=self.name == "local", reason="policy")
        else:
            compat = prefill.info.compat   # decode's reads it (WorkerPool.compatible_with)
            names, block_size, num_tokens = prompt.of(compat), compat.block_size, len(prompt)
            decision = self._decide(num_tokens, prefill, decode, decode_busy,
                                    self.seen.cached_tokens(prefill.address, names, block_size, num_tokens),
                                    self.seen.cached_tokens(decode.address, names, block_size, num_tokens))
            self.seen.record(decode.address, names, block_size)       # computed there, or pulled there
            if not decision.local:
                self.seen.record(prefill.address, names, block_size)
        return self.count(decision)

    def _decide(self, num_prompt_tokens: int, prefill: RatedWorker, decode: RatedWorker, decode_busy: bool,
                prefill_cached: int, decode_cached: int) -> Decision:
        costs, local_rate = self.costs, decode.prefill_tokens_per_s
        if prefill.prefill_tokens_per_s <= 0 or local_rate <= 0:
            return Decision(False, "unmeasured", prefill_cached_tokens=prefill_cached,
                            decode_cached_tokens=decode_cached)
        remote_s = ((costs.queued_tokens[prefill.address] + num_prompt_tokens - prefill_cached)
                    / prefill.prefill_tokens_per_s + costs.handoff_s.value)
        local_s = (costs.queued_tokens[decode.address] + num_prompt_tokens - decode_cached) / local_rate
        stall_s = (num_prompt_tokens - decode_cached) / local_rate
        measured = dict(remote_s=remote_s, local_s=local_s, stall_s=stall_s, prefill_cached_tokens=prefill_cached,
                        decode_cached_tokens=decode_cached)
        if local_s > remote_s:
            return Decision(False, "cheaper_remote", **measured)
        if decode_busy and stall_s > self._max_local_stall_s:
            return Decision(False, "stall", **measured)
        return Decision(True, "cheaper_local", **measured)

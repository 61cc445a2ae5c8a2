"""Per-request placement over workers that can take either role: serve the request whole on one
worker (local), or compute its prompt on P and decode on D from P's KV (remote), whichever the
gateway's live view predicts best (issue 32; TaiChi's unified prefill/decode, Dynamo's conditional
disaggregation generalized to every pair).

For each option the computing worker C (D for local, P for remote) is predicted to take
  compute = prompt tokens C must compute (minus what its prefix cache likely holds) / C's published rate
  ttft    = (prompt tokens queued on C) / C's rate + compute (+ the handoff, remote)
  tpot    = D's decoding step time as D publishes it (worker/step_time.py): what the request's own
            tokens will see, whichever gateway's streams D runs (0 while D serves none)
  harm    = compute x the streams running on C: the token delay this prompt inflicts on them
The choice, in order: an option predicted within the request's TTFT SLO, then within its TPOT SLO
(gateway/slo.py), over one that is not; the least harm (a prompt computed where the fewest streams
wait for it: under long prompts one worker ends up computing for the other, which keeps decoding
undisturbed); the soonest first token; the decode worker with the fewest streams. Ties keep the
listing order (the routing policy's preference first).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gateway.disagg import Decision, DisaggCosts, DisaggPolicy, RatedWorker
from gateway.pool import Worker, WorkerPool
from gateway.prompt_names import PromptNames
from gateway.seen_prefixes import SeenPrefixes
from gateway.slo import RequestSlo
from pdmesh.compat import check_readable
from pdmesh.errors import Incompatible, NoWorkerAvailable


@dataclass(frozen=True)
class Option:
    prefill: RatedWorker | None   # computes the prompt and hands its KV over; None: decode computes it
    decode: RatedWorker
    ttft_s: float
    tpot_s: float                 # predicted for the request's own tokens on its decode worker
    compute_s: float              # of the prompt's tokens not likely cached, on the computing worker
    harm_s: float                 # compute seconds x the streams on the computing worker
    cached_tokens: int            # of the prompt, likely in the computing worker's prefix cache
    decode_streams: int

    @property
    def local(self) -> bool:
        return self.prefill is None

    @property
    def computing(self) -> RatedWorker:
        return self.decode if self.prefill is None else self.prefill

    def decision(self, reason: str = "") -> Decision:
        """As the request's span and answer report it (gateway/disagg.py's Decision)."""
        measured = self.ttft_s != float("inf")
        return Decision(self.local, reason if measured else "unmeasured", tpot_s=self.tpot_s,
                        remote_s=0.0 if self.local or not measured else self.ttft_s,
                        local_s=self.ttft_s if self.local and measured else 0.0,
                        stall_s=self.harm_s if measured else 0.0,
                        prefill_cached_tokens=0 if self.local else self.cached_tokens,
                        decode_cached_tokens=self.cached_tokens if self.local else 0)


def readable(prefill: RatedWorker, decode: RatedWorker) -> bool:
    try:
        check_readable(prefill.info.compat, decode.info.compat)
    except Incompatible:
        return False
    return True


def streams_on(worker) -> int:
    """Requests the worker is serving now (this gateway's, or what it last reported if more)."""
    return worker.queue()


def tpot_with_one_more_s(worker) -> float:
    """The TPOT the worker's streams would see with one stream more, if a step's time grows with its
    batch (0: it decodes none, or has published no step time yet)."""
    num_streams = streams_on(worker)
    return worker.tpot_s() * (num_streams + 1) / num_streams if num_streams else 0.0


@dataclass(frozen=True)
class _Computing:
    """A worker's side of computing this prompt, the same whichever worker then decodes it."""

    compute_s: float
    ttft_s: float      # queued prompts + this one (no handoff)
    harm_s: float
    cached_tokens: int


UNMEASURED = _Computing(0.0, float("inf"), float("inf"), 0)


class Placement:
    def __init__(self, costs: DisaggCosts, seen: SeenPrefixes, slo: RequestSlo) -> None:
        self.costs = costs
        self.seen = seen
        self.slo = slo

    def options(self, prompt: PromptNames, prefills: Sequence[RatedWorker],
                decodes: Sequence[RatedWorker]) -> list[Option]:
        """Every way to serve the request: whole on each decode-capable worker, or from each other
        prefill-capable worker's KV. A worker that has published no rate yet is taken to be as fast as
        the others' mean (the same model on the same kind of machine); none has: every option comes
        last alike, and the least busy worker serves the request whole (its answer brings its rate)."""
        workers = list({id(w): w for w in [*prefills, *decodes]}.values())
        rates = [w.prefill_tokens_per_s for w in workers if w.prefill_tokens_per_s > 0]
        prior = sum(rates) / len(rates) if rates else 0.0
        computing = {id(w): self._computing(prompt, w, prior) for w in workers}
        seen_by = {id(d): (d.tpot_s(), streams_on(d)) for d in decodes}   # tpot (the worker's own), streams
        handoff_s = self.costs.handoff_s.value
        found = [_option(None, d, computing[id(d)], seen_by[id(d)], 0.0) for d in decodes]
        return found + [_option(p, d, computing[id(p)], seen_by[id(d)], handoff_s) for p in prefills
                        for d in decodes if p is not d and readable(p, d)]

    def choose(self, options: Sequence[Option]) -> Option:
        return min(options, key=lambda o: (not self.within_slo(o), round(o.harm_s, 6), o.ttft_s, o.decode_streams))

    def within_slo(self, option: Option) -> bool:
        """Predicted within the request's TTFT SLO, and decoded where streams run within its TPOT SLO."""
        return option.ttft_s <= self.slo.ttft_s and option.tpot_s <= (self.slo.tpot_s or float("inf"))

    def reason(self, options: Sequence[Option], chosen: Option) -> str:
        """Why `chosen`: "past_slo" (no option was within the SLO: the least bad), "soonest" (the
        soonest first token of those within it), "least_harm" (a later first token, to spare running
        streams a prompt's compute)."""
        if not self.within_slo(chosen):
            return "past_slo"
        soonest = min(o.ttft_s for o in options if self.within_slo(o))
        return "soonest" if chosen.ttft_s <= soonest else "least_harm"

    def record(self, prompt: PromptNames, chosen: Option) -> None:
        """The workers that now hold the prompt in their prefix caches (computed there or pulled there)."""
        compat = chosen.decode.info.compat
        names = prompt.of(compat)
        self.seen.record(chosen.decode.address, names, compat.block_size)
        if chosen.prefill is not None:
            self.seen.record(chosen.prefill.address, names, compat.block_size)

    def _computing(self, prompt: PromptNames, worker: RatedWorker, prior_rate: float) -> _Computing:
        rate = worker.prefill_tokens_per_s or prior_rate
        if rate <= 0:
            return UNMEASURED
        compat = worker.info.compat
        num_tokens = len(prompt)
        cached = self.seen.cached_tokens(worker.address, prompt.of(compat), compat.block_size, num_tokens)
        compute_s = (num_tokens - cached) / rate
        return _Computing(compute_s, self.costs.queued_tokens[worker.address] / rate + compute_s,
                          compute_s * streams_on(worker), cached)


def _option(prefill: RatedWorker | None, decode: RatedWorker, computing: _Computing, decode_seen: tuple[float, int],
            handoff_s: float) -> Option:
    tpot_s, decode_streams = decode_seen
    return Option(prefill, decode, computing.ttft_s + handoff_s, tpot_s, computing.compute_s, computing.harm_s,
                  computing.cached_tokens, decode_streams)


async def place(pool: WorkerPool, disagg: DisaggPolicy, prompt: PromptNames, excluded: set[str], slo: RequestSlo,
                moving_from: str = "") -> tuple[Worker | None, Worker, Decision]:
    """(prefill or None: served whole, decode, why) of a request's next attempt, every worker and
    pair weighed; those that failed it (`excluded`) only while no other is up. A stream moving off a
    worker (`moving_from`) is decoded elsewhere (that worker may still hand over its KV); any other
    request asks the streams its compute would put past the TPOT SLO to move (gateway/flows.py)."""
    prefills = [w for w in await pool.candidates("prefill", excluded) if w.info is not None]
    decodes = [w for w in await pool.candidates("decode", excluded) if w.info is not None]
    decodes = [w for w in decodes if w.address != moving_from] or decodes
    if not decodes:   # marked down by another request's failed call while this one waited
        raise NoWorkerAvailable("every decode worker went down")
    placement = Placement(disagg.costs, disagg.seen, slo)
    options = placement.options(prompt, prefills, decodes)
    option = placement.choose(options)
    placement.record(prompt, option)
    computing = option.computing.address
    if not moving_from:
        disagg.flows.ask_at_risk_to_move(computing, option.compute_s, disagg.costs.handoff_s.value,
                                         [tpot_with_one_more_s(w) for w in decodes if w.address != computing])
    reason = "move" if moving_from else placement.reason(options, option)
    return option.prefill, option.decode, disagg.count(option.decision(reason))

"""Flowing decodes (issue 32; TaiChi's decode migration): a stream whose TPOT a prompt computed on
its worker would break moves to another worker, resumed from prompt + the tokens already sent (the
failover path: the client sees each token once).

A prompt computed on worker C delays every stream C decodes by about its compute time: vLLM runs the
prompt's chunks in the steps that make those streams' tokens. When placement sends a prompt's
compute to C, each stream on C whose mean TPOT that delay would take past its SLO, spread over the
tokens it may still make, is asked to move, if the delay is longer than a move takes (the handoff
the gateway has measured) and another worker can decode it. A stream moves at most once: under
load, the worker that took the prompt keeps computing while the others keep decoding.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(eq=False)
class Stream:
    """One attempt's decode stream, as the gateway sees it."""

    worker: str                 # the address decoding it
    num_left: int               # tokens it may still make (max_tokens left)
    tpot_slo_s: float = 0.0     # its request's (0: none: never moved)
    movable: bool = True        # not yet moved (a request moves at most once)
    num_tokens: int = 0         # made in this attempt so far
    first_token_at: float = 0.0
    last_token_at: float = 0.0
    move_asked: bool = False

    def on_tokens(self, num_tokens: int, now: float) -> None:
        if num_tokens <= 0:
            return
        if self.num_tokens == 0:
            self.first_token_at = now
        self.num_tokens += num_tokens
        self.num_left -= num_tokens
        self.last_token_at = now

    def tpot_s(self) -> float:
        """Its mean time per output token so far (0 before its second token)."""
        if self.num_tokens < 2:
            return 0.0
        return (self.last_token_at - self.first_token_at) / (self.num_tokens - 1)

    def tpot_after_stall_s(self, stall_s: float) -> float:
        """Its mean TPOT once it has made every token left, if `stall_s` delays it now."""
        num_after_first = self.num_tokens - 1 + self.num_left
        return self.tpot_s() + stall_s / max(1, num_after_first)


@dataclass
class Flows:
    """The gateway's live decode streams, by worker; asks those at risk to move."""

    streams: dict[str, set[Stream]] = field(default_factory=lambda: defaultdict(set))
    moves_asked: int = 0

    def open(self, worker: str, num_left: int, tpot_slo_s: float, movable: bool) -> Stream:
        stream = Stream(worker, num_left, tpot_slo_s, movable)
        self.streams[worker].add(stream)
        return stream

    def close(self, stream: Stream) -> None:
        on_worker = self.streams.get(stream.worker)
        if on_worker is not None:
            on_worker.discard(stream)
            if not on_worker:
                del self.streams[stream.worker]

    def ask_at_risk_to_move(self, worker: str, stall_s: float, move_s: float,
                            destination_tpots_s: Sequence[float]) -> int:
        """Asks the streams on `worker` that a `stall_s` delay would take past their TPOT SLO to move
        (when moving, `move_s`, costs less than the stall), each only while one of the other workers
        would decode it within its SLO: `destination_tpots_s` holds the TPOT each would run at with
        one stream more (under load every worker is busy: a move would only carry the stall
        elsewhere); returns how many were asked."""
        if stall_s <= move_s or not destination_tpots_s:
            return 0
        calmest_s = min(destination_tpots_s)
        at_risk = [s for s in self.streams.get(worker, ()) if s.movable and not s.move_asked and s.num_tokens >= 2
                   and s.num_left > 1 and 0 < s.tpot_slo_s < s.tpot_after_stall_s(stall_s)
                   and calmest_s <= s.tpot_slo_s]
        for stream in at_risk:
            stream.move_asked = True
        self.moves_asked += len(at_risk)
        return len(at_risk)

"""How fast this engine computes prompt tokens, measured from its own steps: the one estimator of
a worker's prompt rate in the mesh.

The connector's scheduler side sees each step scheduled with its number of tokens; the time to
the next step over that count is the step's rate. Only busy steps count (at least `min_tokens`,
the next one within `max_gap_s`); an exponential moving average smooths them. Who reads it:
- the KV store's loads, as their time budget (a load that takes longer than computing its tokens
  would is cut, and vLLM computes the rest);
- the gateways, which choose where each prompt is computed from it: the worker publishes it with
  every finished request's output and in its registry record.
"""

from __future__ import annotations

import time
from dataclasses import dataclass


class ComputeRate:
    def __init__(self, initial_tokens_per_s: float, min_tokens: int = 256, max_gap_s: float = 2.0,
                 alpha: float = 0.2) -> None:
        self._tokens_per_s = initial_tokens_per_s
        self._min_tokens = min_tokens
        self._max_gap_s = max_gap_s
        self._alpha = alpha
        self._last_start: float | None = None
        self._last_num_tokens = 0
        self.num_samples = 0

    @property
    def tokens_per_s(self) -> float:
        return self._tokens_per_s

    def seconds_for(self, num_tokens: int) -> float:
        return num_tokens / self._tokens_per_s

    def on_step(self, num_scheduled_tokens: int, now: float | None = None) -> None:
        now = time.perf_counter() if now is None else now
        if self._last_start is not None and self._last_num_tokens >= self._min_tokens:
            gap_s = now - self._last_start
            if 0 < gap_s <= self._max_gap_s:
                sample = self._last_num_tokens / gap_s
                self._tokens_per_s += self._alpha * (sample - self._tokens_per_s)
                self.num_samples += 1
        self._last_start, self._last_num_tokens = now, num_scheduled_tokens


DEFAULT_TOKENS_PER_S = 5000.0   # WorkerSettings.initial_prefill_tokens_per_s's default


@dataclass(frozen=True)
class LoadBudget:
    """How long a KV store load may take: `factor` x the time computing its tokens would take at the
    measured rate, or `min_s` if longer (a first connection to a peer is not a slow tier)."""

    factor: float = 1.0
    min_s: float = 0.05

    def seconds(self, rate: ComputeRate, num_tokens: int) -> float:
        return max(self.min_s, self.factor * rate.seconds_for(num_tokens))

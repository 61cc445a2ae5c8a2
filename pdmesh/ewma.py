"""An exponentially weighted moving average whose first sample replaces its initial value."""

from __future__ import annotations


class Ewma:
    def __init__(self, initial: float, alpha: float = 0.2) -> None:
        self.value = initial
        self.num_samples = 0
        self._alpha = alpha

    def observe(self, sample: float) -> None:
        self.value = sample if self.num_samples == 0 else self.value + self._alpha * (sample - self.value)
        self.num_samples += 1

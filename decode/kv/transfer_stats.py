"""Totals of what a consumer's pulls moved (each request's own stats go back with its output)."""

from __future__ import annotations

import threading
from dataclasses import asdict

from pdmesh.kv.request_stats import PullStats


class TransferLedger:
    """Totals of every transfer, thread-safe (per-request stats go back with the engine's output)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._total = PullStats()

    def record(self, stats: PullStats) -> None:
        with self._lock:
            self._total.num_blocks += stats.num_blocks
            self._total.num_bytes += stats.num_bytes
            self._total.seconds += stats.seconds
            self._total.num_failed_blocks += stats.num_failed_blocks
            self._total.num_reused_tokens += stats.num_reused_tokens
            self._total.num_local_tokens += stats.num_local_tokens

    def total(self) -> dict:
        with self._lock:
            return asdict(self._total)

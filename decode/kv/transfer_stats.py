"""Counters of what the connector moved, per request and in total."""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass


@dataclass
class TransferStats:
    num_blocks: int = 0
    num_bytes: int = 0
    seconds: float = 0.0
    first_block_seconds: float = 0.0  # pull start to first verified block: handshake + producer lag
    num_failed_blocks: int = 0
    num_reused_tokens: int = 0   # prompt tokens decode did not compute: local prefix hit + pulled
    num_local_tokens: int = 0    # of those, found in decode's own prefix cache
    transport: str = ""          # what moved the blocks: "shm", "mooncake" or "grpc" ("" when none moved)
    # Layer-wise flow (decode/kv/layerwise_read.py): reading time before prefill's last layer
    # was written and from then until every block was in and verified; the share hidden.
    layerwise: bool = False
    num_layer_reads: int = 0
    seconds_before_prefill_done: float = 0.0
    seconds_after_prefill_done: float = 0.0
    overlap_ratio: float = 0.0


class TransferLedger:
    """Totals of every transfer, thread-safe (per-request stats go back with the engine's output)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._total = TransferStats()

    def record(self, stats: TransferStats) -> None:
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

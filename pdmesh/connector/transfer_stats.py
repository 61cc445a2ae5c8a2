"""Counters of what the connector moved, per request and in total."""

from __future__ import annotations

import threading
from collections import OrderedDict
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


class TransferLedger:
    """Thread-safe; keeps the most recent `max_requests` per-request entries."""

    def __init__(self, max_requests: int = 10_000) -> None:
        self._lock = threading.Lock()
        self._by_request: OrderedDict[str, TransferStats] = OrderedDict()
        self._total = TransferStats()
        self._max_requests = max_requests

    def record(self, request_id: str, stats: TransferStats) -> None:
        with self._lock:
            self._by_request[request_id] = stats
            self._by_request.move_to_end(request_id)
            while len(self._by_request) > self._max_requests:
                self._by_request.popitem(last=False)
            self._total.num_blocks += stats.num_blocks
            self._total.num_bytes += stats.num_bytes
            self._total.seconds += stats.seconds
            self._total.num_failed_blocks += stats.num_failed_blocks
            self._total.num_reused_tokens += stats.num_reused_tokens
            self._total.num_local_tokens += stats.num_local_tokens

    def for_request(self, request_id: str) -> dict | None:
        with self._lock:
            stats = self._by_request.get(request_id)
            return None if stats is None else asdict(stats)

    def total(self) -> dict:
        with self._lock:
            return asdict(self._total)

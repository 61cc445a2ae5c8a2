"""Per-request bookkeeping shared by the servicers: status counts, in-flight gauge, TTFT and ITL."""

from __future__ import annotations

import asyncio
import logging
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager

from opentelemetry import trace

from pdmesh.status_map import grpc_status_of
from pdmesh.telemetry.metrics import MeshMetrics
from pdmesh.telemetry.tracing import current_request_id

logger = logging.getLogger(__name__)


@contextmanager
def observe_request(metrics: MeshMetrics) -> Iterator[None]:
    """Counts the request by final status and keeps the in-flight gauge; marks the span on error."""
    in_flight = metrics.in_flight.labels(metrics.role)
    in_flight.inc()
    status = "OK"
    try:
        yield
    except asyncio.CancelledError:   # the caller cancelled or its connection dropped: its call is gone
        status = "CANCELLED"
        logger.info("%s request %s cancelled by its caller", metrics.role, current_request_id() or "-")
        raise
    except Exception as exc:
        status = grpc_status_of(exc).name
        span = trace.get_current_span()
        span.record_exception(exc)
        span.set_status(trace.Status(trace.StatusCode.ERROR, str(exc)))
        raise
    finally:
        in_flight.dec()
        metrics.requests.labels(metrics.role, status).inc()


class TokenTimer:
    """Records time to first token and inter-token latency as chunks stream out."""

    def __init__(self, metrics: MeshMetrics) -> None:
        self._ttft = metrics.ttft.labels(metrics.role)   # looked up once, not per token
        self._itl = metrics.itl.labels(metrics.role)
        self._started = time.perf_counter()
        self._last: float | None = None
        self.ttft_s: float | None = None
        self.itl_s: list[float] = []

    def on_chunk(self, num_tokens: int) -> None:
        if num_tokens == 0:
            return
        now = time.perf_counter()
        if self._last is None:
            self.ttft_s = now - self._started
            self._ttft.observe(self.ttft_s)
        else:
            self.itl_s.append(now - self._last)
            self._itl.observe(self.itl_s[-1])
        self._last = now

    def span_attributes(self) -> dict[str, float]:
        attributes = {"pdmesh.ttft_s": self.ttft_s or 0.0}
        if self.itl_s:
            attributes |= {"pdmesh.itl_p50_s": statistics.median(self.itl_s), "pdmesh.itl_max_s": max(self.itl_s)}
        return attributes

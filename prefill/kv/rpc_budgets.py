"""Concurrency budgets on a thread-pool gRPC server (a worker's KV port). Each group of methods that
can hold a thread for long (a long poll, a wait for a hold, a stream to a slow reader, a store read)
holds at most its budget of the server's threads; a call past its group's budget is answered
RESOURCE_EXHAUSTED (Overloaded) at once instead of queueing behind the others. The server has more
threads than the budgets together, so the calls no budget holds (handshakes, releases, health
checks) and each group's first calls always find a thread: peers that flood one method cannot
starve another (a KV pull, the local scheduler's store Lookup)."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from pdmesh.errors import Overloaded
from pdmesh.status_map import error_metadata, grpc_status_of


@dataclass(frozen=True)
class RpcBudget:
    name: str
    methods: tuple[str, ...]  # full method names: "/package.Service/Method"
    max_in_flight: int        # calls of these methods running at once


def threads_for(budgets: Sequence[RpcBudget], free_threads: int) -> int:
    """Server threads that leave `free_threads` to unbudgeted calls with every budget in use."""
    return sum(budget.max_in_flight for budget in budgets) + free_threads


class RpcBudgetInterceptor(grpc.ServerInterceptor):
    """Applies budgets to a sync server's unary and server-streaming methods."""

    def __init__(self, budgets: Sequence[RpcBudget]) -> None:
        self._budgets: dict[str, tuple[str, threading.BoundedSemaphore]] = {}  # method: (budget name, its slots)
        for budget in budgets:
            slots = threading.BoundedSemaphore(budget.max_in_flight)
            for method in budget.methods:
                self._budgets[method] = (budget.name, slots)
        self._lock = threading.Lock()
        self.num_refused: Counter[str] = Counter()  # budget name: calls refused past it

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        budget = self._budgets.get(handler_call_details.method)
        if handler is None or budget is None or handler.request_streaming:
            return handler
        name, slots = budget
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(self._stream(handler.unary_stream, name, slots),
                                                        handler.request_deserializer, handler.response_serializer)
        return grpc.unary_unary_rpc_method_handler(self._unary(handler.unary_unary, name, slots),
                                                   handler.request_deserializer, handler.response_serializer)

    def _unary(self, behavior, name: str, slots: threading.BoundedSemaphore):
        def budgeted(request, context):
            self._take(slots, name, context)
            try:
                return behavior(request, context)
            finally:
                slots.release()

        return budgeted

    def _stream(self, behavior, name: str, slots: threading.BoundedSemaphore):
        def budgeted(request, context):
            self._take(slots, name, context)
            try:
                yield from behavior(request, context)
            finally:  # the stream ended, failed or was closed (its reader went away)
                slots.release()

        return budgeted

    def _take(self, slots: threading.BoundedSemaphore, name: str, context) -> None:
        """A slot of the budget, or the call is refused (aborts it)."""
        if slots.acquire(blocking=False):
            return
        with self._lock:
            self.num_refused[name] += 1
        refusal = Overloaded(f"this KV port is at its limit of concurrent {name} calls; retry later")
        context.set_trailing_metadata(error_metadata(refusal))
        context.abort(grpc_status_of(refusal), str(refusal))

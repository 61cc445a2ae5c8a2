"""Scheduler side of the KV store: asks the engine's own store (in the worker process, over
its KVStore service) how much of a prompt is cached, locally or on other nodes.

The engine's scheduler never waits for that answer: `AsyncStoreLookup.poll` starts the lookup on a
thread and answers None ("not yet": vLLM asks again at its next step) until it is in, or until the
request has waited `max_wait_s` since its lookup was asked for: then it is a miss and the prompt is
computed. Lookups queue on a few threads; when the store answers slowly (its Redis or its worker
starved of CPU), a burst of requests would otherwise wait one lookup timeout per place in the queue
(the soak of 2026-12-06 logged 14 timeouts of 1 s in a row, the engine idle meanwhile).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from kvstore.client import GrpcStoreClient
from pdmesh.errors import PDMeshError
from pdmesh.transport.mesh_auth import MeshAuth

logger = logging.getLogger(__name__)


def num_loadable_blocks(num_prompt_tokens: int, block_size: int) -> int:
    """Full blocks that may be loaded: the last prompt token is always computed (it yields the logits)."""
    return max(num_prompt_tokens - 1, 0) // block_size


class StoreLookup:
    def __init__(self, store_address: str, block_size: int, timeout_s: float, auth: MeshAuth | None = None) -> None:
        self._store_address = store_address
        self._block_size = block_size
        self._timeout_s = timeout_s
        self._client = GrpcStoreClient(compat=None, timeout_s=timeout_s, auth=auth)

    def nodes_of_cached_prefix(self, prompt_token_ids: Sequence[int], block_hashes: Sequence[bytes]) -> list[str]:
        """For each block of the longest cached prefix, the node holding it ("" = this one), from the
        names of the prompt's blocks (the request's, hashed once). Any failure is a miss: the prompt is
        computed."""
        num_blocks = num_loadable_blocks(len(prompt_token_ids), self._block_size)
        if num_blocks == 0:
            return []
        try:
            sources = self._client.lookup(self._store_address, prompt_token_ids[:num_blocks * self._block_size],
                                          include_remote=True, timeout_s=self._timeout_s,
                                          block_hashes=block_hashes[:num_blocks])
        except PDMeshError as exc:
            logger.warning("KV store lookup failed (%s); computing the prompt", exc)
            return []
        return [source.node for source in sources]

    def close(self) -> None:
        self._client.close()


class AsyncStoreLookup:
    """Lookups on a small thread pool, one per request, polled by the scheduler each step."""

    def __init__(self, lookup: StoreLookup, max_workers: int = 2, max_wait_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._lookup = lookup
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="pdmesh-kv-lookup")
        self._pending: dict[str, tuple[Future, float]] = {}   # request id: (its lookup, when asked for)
        self._max_wait_s = max_wait_s
        self._clock = clock
        self.num_given_up = 0   # lookups not answered within max_wait_s: those prompts were computed

    def poll(self, request_id: str, prompt_token_ids: Sequence[int],
             block_hashes: Sequence[bytes]) -> list[str] | None:
        """The nodes of the cached prefix once known (then forgotten here); None while the lookup runs;
        [] (a miss) once the request has waited max_wait_s."""
        pending = self._pending.get(request_id)
        if pending is None:
            future = self._pool.submit(self._lookup.nodes_of_cached_prefix, list(prompt_token_ids), list(block_hashes))
            self._pending[request_id] = (future, self._clock())
            return None
        future, asked_at = pending
        if not future.done() and self._clock() - asked_at < self._max_wait_s:
            return None
        del self._pending[request_id]
        if future.done():
            return future.result()  # nodes_of_cached_prefix turns every failure into a miss ([])
        future.cancel()   # still queued: it never runs; running: its answer is dropped
        self.num_given_up += 1
        logger.info("request %s: no KV store answer in %.1f s; computing the prompt", request_id, self._max_wait_s)
        return []

    def forget(self, request_id: str) -> None:
        """The request left before its answer was used (aborted, finished)."""
        pending = self._pending.pop(request_id, None)
        if pending is not None:
            pending[0].cancel()

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._lookup.close()

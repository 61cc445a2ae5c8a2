"""Saves finished prompts' full blocks into the node's KV store off prefill's critical path.

Two stages, one thread each (both off the engine's core):
1. copy-out: one batched copy of the blocks the store lacks (`PagedKVCache.read_blocks`), then the
   transfer's lease ends at once: the engine's blocks stay pinned only while decode pulls them,
   never while the store writes, demotes or fsyncs.
2. write: the copies go into the store (tiers, demotions, Redis index).
Back-pressure: a save that would take the staged bytes past `max_pending_bytes` is skipped and
counted — that prompt is not cached, and prefill never waits for the store.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor

import torch
from opentelemetry import context

from kvstore.store_agent import StoreAgent
from pdmesh.kv.tasks import SendTask
from pdmesh.telemetry.tracing import extract_carrier, tracer
from pdmesh.transport.affinity import widen_affinity
from prefill.kv.held_transfers import HeldTransfers
from worker.paged_kv import PagedKVCache

logger = logging.getLogger(__name__)
INDEX_WAIT_S = 5.0   # a save waits this long at most for its index entries (Redis slow or down)


class StoreSaver:
    def __init__(self, store: StoreAgent, paged: PagedKVCache, held: HeldTransfers, max_pending_bytes: int) -> None:
        self._store = store
        self._paged = paged
        self._held = held
        self._max_pending_bytes = max_pending_bytes
        self._cond = threading.Condition()
        self._num_pending = 0
        self._pending_bytes = 0
        self.num_skipped = 0          # saves skipped under back-pressure
        self.num_skipped_blocks = 0
        self._copy_pool = ThreadPoolExecutor(1, thread_name_prefix="pdmesh-kv-copyout", initializer=widen_affinity)
        self._write_pool = ThreadPoolExecutor(1, thread_name_prefix="pdmesh-kv-save", initializer=widen_affinity)

    def submit(self, send: SendTask) -> bool:
        """Queues the save of `send`'s full blocks (leasing them until copied); False when skipped."""
        nbytes = self._store.num_full_blocks(send) * self._paged.block_nbytes
        if nbytes == 0:
            return False
        with self._cond:
            if self._pending_bytes + nbytes > self._max_pending_bytes:
                self.num_skipped += 1
                self.num_skipped_blocks += nbytes // self._paged.block_nbytes
                return False
            self._num_pending += 1
            self._pending_bytes += nbytes
        self._held.lease(send.transfer_id)  # before the hold: decode may release at once
        self._copy_pool.submit(self._copy_out, send, nbytes)
        return True

    def flush(self, timeout_s: float) -> bool:
        """Waits until every queued save is done (tests, shutdown); False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self._num_pending == 0, timeout=timeout_s)

    @property
    def num_pending(self) -> int:
        """Saves queued, copying out, writing or waiting for their index entries to be sent."""
        with self._cond:
            return self._num_pending

    def shutdown(self) -> None:
        self._copy_pool.shutdown(wait=True, cancel_futures=True)
        self._write_pool.shutdown(wait=True, cancel_futures=True)

    def _copy_out(self, send: SendTask, nbytes: int) -> None:
        try:
            missing = self._store.missing_blocks(send)
            rows = self._paged.read_blocks([block_id for _, block_id in missing])
        except Exception:  # noqa: BLE001 - a failed save loses a cache entry, never the request
            logger.warning("transfer %s: copying blocks out for the KV store failed", send.transfer_id, exc_info=True)
            self._done(nbytes)
            return
        finally:
            self._held.unlease(send.transfer_id)
        self._write_pool.submit(self._write, send, [key for key, _ in missing], rows, nbytes)

    def _write(self, send: SendTask, keys: list, rows: torch.Tensor, nbytes: int) -> None:
        token = context.attach(extract_carrier(send.trace_carrier))
        try:
            with tracer().start_as_current_span("kvstore.save") as span:
                num_saved = self._store.put_rows(keys, rows)
                self._store.touch_prompt(send)
                # a save ends once its blocks are in the index (this thread waits, no request does)
                if not self._store.flush_index(INDEX_WAIT_S):
                    logger.info("transfer %s: saved, its index entries still queued", send.transfer_id)
                span.set_attributes({"pdmesh.kvstore.blocks_saved": num_saved,
                                     "pdmesh.kvstore.bytes_saved": num_saved * self._paged.block_nbytes})
        except Exception:  # noqa: BLE001 - a failed save loses a cache entry, never the request
            logger.warning("transfer %s: saving to the KV store failed", send.transfer_id, exc_info=True)
        finally:
            context.detach(token)
            self._done(nbytes)

    def _done(self, nbytes: int) -> None:
        with self._cond:
            self._num_pending -= 1
            self._pending_bytes -= nbytes
            self._cond.notify_all()

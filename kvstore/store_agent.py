"""Worker side of the KV store on a prefill engine: owns the node's tiers and index, saves the
full blocks of finished prompts (on a background thread, while decode still holds them pinned),
and loads cached blocks into the paged cache instead of computing them: its own with one batched
read per tier, another node's through that node's export (kvstore/store_export.py), read like a
prefill's KV through the transport agreed with the node (pdmesh/transport/kv_transport.py)."""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from itertools import groupby
from pathlib import Path

import numpy as np
import torch

from decode.kv.kv_links import KVLinks
from decode.kv.kv_port_client import wait_briefly
from kvstore.block_key import BlockKey, keys_of
from kvstore.block_store import TieredBlockStore
from kvstore.client import GrpcStoreClient
from kvstore.disk_tier import DiskTier
from kvstore.index_publisher import BackgroundPublisher
from kvstore.redis_index import RedisBlockIndex
from kvstore.service import SERVICE_NAME, KVStoreServicer
from kvstore.slab_tier import device_tier, host_tier
from kvstore.store_export import StoreExports
from kvstore.tier import BlockTier
from pdmesh.config import StoreSettings
from pdmesh.errors import BlockHashMismatch, Overloaded, PDMeshError, TransferNotFound
from pdmesh.kv.fault_hooks import NO_FAULTS, KVFaultHooks
from pdmesh.kv.request_stats import StoreLoadStats
from pdmesh.kv.tasks import SendTask, StoreLoadTask
from pdmesh.transport.mesh_auth import MeshAuth
from pdmesh.v1 import common_pb2, kv_store_pb2_grpc
from prefill.kv.grpc_kv_server import ExtraService

logger = logging.getLogger(__name__)
REMOTE = "remote"  # tier label of blocks fetched from another node's store
LOAD_BATCH_BLOCKS = 16  # blocks read from the store per batch: one copy per tier, budget checked between
EXPORT_BATCH_NBYTES = 16 << 20  # asked of another node's store per export, budget checked between


class LoadBudgetExceeded(Exception):
    """A load ran past its time budget: computing the rest is cheaper than waiting for it."""


def build_tiers(settings: StoreSettings, block_nbytes: int, device: str,
                faults: KVFaultHooks = NO_FAULTS) -> list[BlockTier]:
    tiers: list[BlockTier] = []
    if settings.device_bytes >= block_nbytes:
        tiers.append(device_tier(settings.device_bytes, block_nbytes, device))
    if settings.dram_bytes >= block_nbytes:
        tiers.append(host_tier(settings.dram_bytes, block_nbytes, pin_memory=device not in ("cpu", "")))
    if settings.nvme_dir is not None and settings.nvme_bytes >= block_nbytes:
        tiers.append(DiskTier(Path(settings.nvme_dir).expanduser(), settings.nvme_bytes, block_nbytes,
                              fsync=settings.nvme_fsync))
    return [faults.store_tier(tier, index, len(tiers), block_nbytes) for index, tier in enumerate(tiers)]


class StoreAgent:
    def __init__(self, settings: StoreSettings, compat: common_pb2.CompatInfo, device: str,
                 pieces: list[tuple[int, int]], auth: MeshAuth | None = None,
                 faults: KVFaultHooks = NO_FAULTS) -> None:
        """pieces: (num_parts, part_nbytes) of each layer of the engine's KV cache."""
        self._block_size = compat.block_size
        tiers = build_tiers(settings, compat.block_nbytes, device, faults)
        self.index = (RedisBlockIndex.connect(settings.redis_url, settings.redis_password,
                                              namespace=compat.model_fingerprint, node="",
                                              ttl_s=settings.index_ttl_s, mesh_token=auth.token if auth else None)
                      if settings.redis_url else None)
        self.store = TieredBlockStore(tiers, compat.block_nbytes,
                                      piece_nbytes=[part_nbytes for num_parts, part_nbytes in pieces
                                                    for _ in range(num_parts)])
        self._capacity_blocks = sum(tier.capacity_blocks for tier in tiers)
        self.exports = StoreExports(self.store, pieces, settings.export_bytes, hold_s=2 * settings.fetch_timeout_s)
        self.servicer = KVStoreServicer(compat, self.store, self.index, self.exports)
        self._client = GrpcStoreClient(compat, timeout_s=settings.fetch_timeout_s, auth=auth)
        self._fetch_timeout_s = settings.fetch_timeout_s
        self._links: KVLinks | None = None  # to other nodes' store exports (connect)
        self._publisher: BackgroundPublisher | None = None  # the index's updates, once attached
        self._lock = threading.Lock()
        self._buffers = threading.local()
        self._totals: Counter[str] = Counter()
        logger.info("KV store tiers: %s", ", ".join(f"{t.name}={t.capacity_blocks} blocks" for t in tiers))

    def connect(self, links: KVLinks) -> None:
        """How this node reads other nodes' exports (store links, over its engine's KV cache)."""
        self._links = links

    def extra_service(self) -> ExtraService:
        return ExtraService(SERVICE_NAME, kv_store_pb2_grpc.add_KVStoreServicer_to_server, self.servicer)

    def attach(self, node_address: str) -> None:
        """Once the node's address is known: mirror the store into the index, recovered blocks first."""
        if self.index is None:
            return
        self.index.node = node_address
        # room for the announcement of every block the tiers can hold, twice over
        self._publisher = BackgroundPublisher(self.index, max_backlog=max(65536, 2 * self._capacity_blocks))
        self.store.set_listener(self._publisher)   # no store change waits for Redis
        self.store.announce_all()

    # ---- save ----
    def num_full_blocks(self, send: SendTask) -> int:
        return min(len(send.token_ids) // self._block_size, len(send.block_ids))

    def missing_blocks(self, send: SendTask) -> list[tuple[BlockKey, int]]:
        """(key, engine block id) of the prompt's full blocks the store lacks, in prompt order."""
        keys = keys_of(send.block_hashes, send.token_ids, self._block_size)  # the request's, hashed once
        return [(key, block_id) for key, block_id in zip(keys, send.block_ids) if not self.store.has(key)]

    def touch_prompt(self, send: SendTask) -> None:
        """After a prompt's save: its blocks the most recently used, its head last of all (a prefix
        loses its end before its start; the save touched the blocks it found head first)."""
        self.store.longest_prefix(keys_of(send.block_hashes, send.token_ids, self._block_size))

    def put_rows(self, keys: list[BlockKey], rows) -> int:
        """Puts row i of `rows` (a (n, block_nbytes) uint8 tensor) under keys[i], as one batch;
        returns how many leading blocks the store holds (out of space: the rest is not saved)."""
        num_saved = self.store.put_many(keys, rows.numpy())
        with self._lock:
            self._totals["blocks_saved"] += num_saved
        return num_saved

    # ---- load ----
    def load(self, task: StoreLoadTask, write_blocks, budget_s: float = float("inf")) -> StoreLoadStats:
        """Loads the task's blocks in order (this node's through `write_blocks(local_block_ids, rows)`,
        other nodes' through the links `connect` gave); stops at the first that fails, or once
        loading has taken `budget_s` (what computing the blocks would cost): the rest is computed."""
        started = time.perf_counter()
        keys = keys_of(task.block_hashes, task.token_ids, self._block_size)   # the request's, hashed once
        planned = list(zip(task.block_indexes, task.local_block_ids, task.nodes))
        stats = StoreLoadStats(num_local_tokens=task.num_local_tokens, budget_s=budget_s)
        deadline = started + budget_s
        try:
            for node, run in groupby(planned, key=lambda item: item[2]):
                run = list(run)
                self._load_run(node, [(keys[i], local_id) for i, local_id, _ in run], write_blocks, stats,
                               deadline)
        except LoadBudgetExceeded:
            stats.cut = True
            logger.info("request %s: KV store load cut at its %.3f s budget after %d of %d blocks; computing the rest",
                        task.request_id, budget_s, stats.num_blocks, len(planned))
        except Exception as exc:  # noqa: BLE001 - a failed load becomes recompute, never a crash
            logger.warning("request %s: KV store load stopped after %d of %d blocks and %.3f s (%s: %s); "
                           "computing the rest", task.request_id, stats.num_blocks, len(planned),
                           time.perf_counter() - started, type(exc).__name__, exc)
        stats.num_failed_blocks = len(planned) - stats.num_blocks
        stats.seconds = time.perf_counter() - started
        self._record(stats)
        return stats

    def _load_run(self, node: str, run: list[tuple[BlockKey, int]], write_blocks, stats: StoreLoadStats,
                  deadline: float) -> None:
        if node == "":
            for start in range(0, len(run), LOAD_BATCH_BLOCKS):
                batch = run[start:start + LOAD_BATCH_BLOCKS]
                rows, tiers = self.store.read_prefix([key for key, _ in batch], self._load_buffer())
                write_blocks([local_id for _, local_id in batch[:len(tiers)]], torch.from_numpy(rows))
                for tier in tiers:
                    self._count(stats, tier, rows.shape[1])
                if len(tiers) < len(batch):
                    raise TransferNotFound(f"block {batch[len(tiers)][0].block_hash.hex()} left the store or was corrupt")
                self._check_budget(deadline)
            return
        self._fetch_run(node, run, stats, deadline)

    def _fetch_run(self, node: str, run: list[tuple[BlockKey, int]], stats: StoreLoadStats, deadline: float) -> None:
        """Loads a run of blocks `node` holds: it exports them a batch at a time (the next batch's
        export is asked for while this one is read), and each batch is read straight into the
        paged cache (verified) by the transport agreed with it."""
        per_export = max(1, EXPORT_BATCH_NBYTES // self.store.block_nbytes)
        batches = [run[start:start + per_export] for start in range(0, len(run), per_export)]
        pending = released = None
        try:
            link = self._links.link(node)
            stats.transport = link.transport
            keys = [[key for key, _ in batch] for batch in batches]
            pending = self._client.export_soon(node, keys[0])
            for number, batch in enumerate(batches):
                try:
                    transfer_id, num_held = pending()
                except Overloaded:
                    if not number:
                        raise
                    pending = None  # asked ahead while the batch before held the node's slab: room once released
                    wait_briefly([released], min(self._fetch_timeout_s, max(0.0, deadline - time.perf_counter())))
                    transfer_id, num_held = self._client.export(node, keys[number])
                pending = (self._client.export_soon(node, keys[number + 1])
                           if number + 1 < len(batches) and num_held == len(batch) else None)
                if num_held:
                    try:
                        self._read_export(link, transfer_id, batch[:num_held], stats)
                    finally:
                        released = self._links.control.release_soon(link.address, transfer_id)
                        wait_briefly([released])
                if num_held < len(batch):
                    raise TransferNotFound(f"{node} no longer holds block {batch[num_held][0].block_hash.hex()}")
                self._check_budget(deadline)
        except PDMeshError as exc:
            if not isinstance(exc, (TransferNotFound, BlockHashMismatch, Overloaded)):
                # the node may be gone, or back on this address with another slab (a stale mapping
                # reads as a checksum mismatch): handshake again next time
                self._links.forget(node)
            raise
        finally:
            if pending is not None:  # a batch exported ahead that will not be read: free it now
                self._release_read_ahead(node, pending)

    def _release_read_ahead(self, node: str, pending) -> None:
        """Frees a batch exported ahead of a load that stopped before reading it."""
        try:
            transfer_id, num_held = pending()
        except PDMeshError:
            return  # not exported: nothing to free
        if num_held:
            self._links.control.release_soon(node, transfer_id)

    def _read_export(self, link, transfer_id: str, batch: list[tuple[BlockKey, int]], stats: StoreLoadStats) -> None:
        reader = self._links.reader(link)
        num_before = 0
        for num_landed in reader.read_blocks(link, transfer_id, range(len(batch)), [local_id for _, local_id in batch],
                                             [key.block_hash for key, _ in batch]):
            self._count(stats, REMOTE, self.store.block_nbytes, num_landed - num_before)
            num_before = num_landed

    def _load_buffer(self) -> np.ndarray:
        """This thread's reused batch buffer (fresh pages would cost a fault each, every load)."""
        buffer = getattr(self._buffers, "rows", None)
        if buffer is None:
            buffer = self._buffers.rows = np.empty((LOAD_BATCH_BLOCKS, self.store.block_nbytes), dtype=np.uint8)
        return buffer

    def _count(self, stats: StoreLoadStats, tier: str, nbytes: int, num_blocks: int = 1) -> None:
        """Counts num_blocks blocks of nbytes each loaded from `tier`."""
        stats.tokens_by_tier[tier] = stats.tokens_by_tier.get(tier, 0) + num_blocks * self._block_size
        stats.num_blocks += num_blocks
        stats.num_bytes += num_blocks * nbytes

    @staticmethod
    def _check_budget(deadline: float) -> None:
        if time.perf_counter() > deadline:
            raise LoadBudgetExceeded

    # ---- stats ----
    def _record(self, stats: StoreLoadStats) -> None:
        with self._lock:
            self._totals["blocks_loaded"] += stats.num_blocks
            self._totals["failed_blocks"] += stats.num_failed_blocks
            self._totals["remote_blocks"] += stats.tokens_by_tier.get(REMOTE, 0) // self._block_size
            self._totals["loads_cut"] += int(stats.cut)

    def spill(self, tier: str) -> int | None:
        """Blocks moved down into `tier` (a drain before a restart); None when the store has no such tier."""
        return self.store.spill(tier) if tier in self.store.tier_names else None

    def counters(self) -> dict:
        """Field names of pdmesh.v1.WorkerStats."""
        with self._lock:
            totals = dict(self._totals)
        return {
            "kv_store_blocks": self.store.num_blocks,
            "kv_store_occupancy_bytes": self.store.occupancy_bytes(),
            "kv_store_hit_blocks": {**self.store.hits, REMOTE: totals.get("remote_blocks", 0)},
            "kv_store_corrupt_blocks": sum(self.store.corrupt.values()),
            "kv_store_corrupt_blocks_by_tier": dict(self.store.corrupt),
            "kv_store_blocks_saved": totals.get("blocks_saved", 0),
            "kv_store_blocks_loaded": totals.get("blocks_loaded", 0),
            "kv_store_failed_blocks": totals.get("failed_blocks", 0),
            "kv_store_pinned_blocks": self.store.num_pinned,
            "kv_store_dropped_blocks": self.store.num_dropped,
            "kv_store_index_errors": self.index.num_errors if self.index else 0,
            "kv_store_index_dropped_events": self._publisher.num_dropped if self._publisher else 0,
            "kv_store_loads_cut": totals.get("loads_cut", 0),
        }

    def close(self) -> None:
        self._client.close()
        if self._links is not None:
            self._links.close()
        self.exports.close()
        if self._publisher is not None:
            self._publisher.close()
        if self.index is not None:
            self.index.close()

    def flush_index(self, timeout_s: float) -> bool:
        """Waits until the store's changes so far were sent to the index (not those made meanwhile);
        False on timeout."""
        return self._publisher.flush(timeout_s) if self._publisher else True

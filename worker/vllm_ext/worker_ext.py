"""Methods vLLM adds to its worker (parallel_config.worker_extension_cls) so the serving
process can read the connector's state through `engine.collective_rpc`."""

from __future__ import annotations

from pdmesh.gc_heap import freeze_startup_heap


class PDMeshWorkerExtension:
    def pdmesh_compat(self) -> bytes:
        """The worker's CompatInfo, serialized."""
        return _connector_worker().compat.SerializeToString()

    def pdmesh_store_spill(self, tier: str) -> int | None:
        """Blocks moved down into `tier`; None without a store or such a tier."""
        return _connector_worker().spill_store(tier)

    def pdmesh_release_request(self, request_id: str) -> int:
        """Frees the KV a cancelled prefill request holds (or will hold once the engine registers it)."""
        return _connector_worker().release_request(request_id)

    def pdmesh_release_transfer(self, transfer_id: str) -> bool:
        """Frees a transfer no decode will pull (the gateway's release, through the Prefill service)."""
        return _connector_worker().release_transfer(transfer_id)

    def pdmesh_freeze_gc(self) -> tuple[int, float]:
        """Freezes the worker's start-up heap (pdmesh/gc_heap.py): (objects frozen, seconds the full
        collection before the freeze took)."""
        frozen = freeze_startup_heap()
        return frozen.num_objects, frozen.collect_s

    def pdmesh_counters(self) -> dict:
        """Field names of pdmesh.v1.WorkerStats."""
        return _connector_worker().counters()

    def pdmesh_dist_store(self) -> str:
        """The file of this engine's torch.distributed FileStore ('' for a TCP rendezvous), which the
        serving process records: a killed engine leaves it (pdmesh/engine_debris.py)."""
        method = getattr(self, "distributed_init_method", None) or ""
        return method.removeprefix("file://") if method.startswith("file://") else ""


def _connector_worker():
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group().worker

"""Per-step messages from the connector's scheduler side to its worker side."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from pdmesh.kv.tasks import LayerwiseStep, RecvTask, SendTask, StoreLoadTask


@dataclass
class PDMeshConnectorMetadata(KVConnectorMetadata):
    sends: list[SendTask] = field(default_factory=list)
    recvs: list[RecvTask] = field(default_factory=list)
    loads: list[StoreLoadTask] = field(default_factory=list)
    layerwise_steps: list[LayerwiseStep] = field(default_factory=list)
    layerwise_restarted: list[str] = field(default_factory=list)  # transfer ids whose request was preempted
    layerwise_ended: list[str] = field(default_factory=list)      # transfer ids that will never be held
    # Pull flow: ids minted for requests scheduled this step, before any can leave the engine (the
    # producer waits for their holds, and answers a read of any other id at once) ...
    minted_transfer_ids: list[str] = field(default_factory=list)
    # ... and minted ids whose requests ended without handing their KV over (never held).
    unheld_transfer_ids: list[str] = field(default_factory=list)


@dataclass
class PDMeshWorkerMeta(KVConnectorWorkerMetadata):
    """Worker → scheduler, with a step's output: what each request's KV transfer or store load did
    (engine request id → PullStats / StoreLoadStats, encoded: pdmesh/kv/request_stats.py), sent in the step the worker
    reports the request received. The scheduler returns it in the request's kv_transfer_params."""

    stats: dict[str, dict] = field(default_factory=dict)

    def aggregate(self, other: "KVConnectorWorkerMetadata") -> "PDMeshWorkerMeta":
        if isinstance(other, PDMeshWorkerMeta):
            return PDMeshWorkerMeta({**self.stats, **other.stats})
        return self

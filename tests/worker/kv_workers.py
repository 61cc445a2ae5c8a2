"""Producer and consumer ConnectorWorkers over a small random KV cache, for the worker-side tests."""

from __future__ import annotations

import torch

from pdmesh.config import KVFaultSettings, KVTransportSettings, TelemetrySettings
from pdmesh.kv.tasks import RecvTask
from tests.kv_task_names import named
from worker.metadata import PDMeshConnectorMetadata
from worker.worker_side import ConnectorWorker

BLOCK_SIZE, NUM_BLOCKS = 32, 8
TOKENS = list(range(3, 3 + 80))  # 3 blocks, the last one partial
TRANSPORTS = ["shm", "mooncake", "grpc"]
FAULTS = KVFaultSettings(tamper_request_prefix="tamper-", unverified_request_prefix="tamper-unverified-")


def make_worker(model_dir, is_producer: bool, transport: str, shape=(NUM_BLOCKS, 2, BLOCK_SIZE, 16),
            pull_timeout_s: float = 10) -> ConnectorWorker:
    worker = ConnectorWorker(model=str(model_dir), block_size=BLOCK_SIZE, is_producer=is_producer,
                             kv_host="127.0.0.1", kv_port=0, hold_timeout_s=60, pull_timeout_s=pull_timeout_s,
                             telemetry=TelemetrySettings(),
                             transport=KVTransportSettings(kv_transport=transport, mooncake_host="127.0.0.1", kv_faults=FAULTS))
    caches = {f"l{i}": (torch.randn if is_producer else torch.zeros)(*shape) for i in range(2)}
    worker.register_kv_caches(caches, NUM_BLOCKS)
    worker.caches = caches
    return worker


def recv_task(producer: ConnectorWorker, local_block_ids: list[int], mesh_id: str = "mesh-1",
               transfer_id: str = "p-1") -> RecvTask:
    return named(producer, RecvTask(request_id="d-1", pdmesh_request_id=mesh_id, transfer_id=transfer_id,
                                    kv_address=producer.producer.server.address, block_indexes=[0, 1, 2],
                                    local_block_ids=local_block_ids, token_ids=TOKENS))


def finish(worker: ConnectorWorker, meta: PDMeshConnectorMetadata) -> None:
    worker.start_tasks(meta)
    worker.consumer.pool.shutdown(wait=True)  # let the pull finish before asserting


def same_block(consumer, producer, local: int, remote: int) -> bool:
    return all(torch.equal(consumer.caches[name][local], producer.caches[name][remote]) for name in producer.caches)

"""A prefill worker's KV store lookup against a forged index entry (no vLLM; two producers with real
tiers, a real Redis index and the mesh token, over their real KV ports): an attacker who can write
to Redis names its own node as the holder of a prompt's next blocks. The lookup that decides where
the worker loads KV from stops at the genuine node's blocks; the forged entries are counted."""

from __future__ import annotations

import pytest
import torch

from kvstore.block_key import block_keys
from kvstore.store_lookup import StoreLookup
from pdmesh.compat import fingerprint_seed
from pdmesh.config import KVTransportSettings, StoreSettings, TelemetrySettings
from pdmesh.kv.tasks import SendTask
from pdmesh.transport.mesh_auth import MeshAuth
from tests.kv_task_names import named, names
from worker.metadata import PDMeshConnectorMetadata
from worker.worker_side import ConnectorWorker

TOKEN = "mesh-secret-of-this-deployment"
ATTACKER = "203.0.113.66:7000"
BLOCK_SIZE, NUM_BLOCKS = 32, 8
BLOCK_NBYTES = 2 * 2 * BLOCK_SIZE * 16 * 4
PROMPT = list(range(3, 3 + 4 * BLOCK_SIZE + 1))   # 4 loadable blocks (the last token is computed)


def _producer(model_dir, redis_server) -> ConnectorWorker:
    store = StoreSettings(device_bytes=0, dram_bytes=4 * BLOCK_NBYTES, nvme_bytes=0, redis_url=redis_server.url,
                          redis_password=redis_server.password, export_bytes=3 * BLOCK_NBYTES)
    worker = ConnectorWorker(model=str(model_dir), block_size=BLOCK_SIZE, is_producer=True, kv_host="127.0.0.1",
                             kv_port=0, hold_timeout_s=60, pull_timeout_s=10, telemetry=TelemetrySettings(),
                             store=store, transport=KVTransportSettings(kv_transport="grpc", mesh_token=TOKEN))
    worker.register_kv_caches({f"l{i}": torch.randn(NUM_BLOCKS, 2, BLOCK_SIZE, 16) for i in range(2)}, NUM_BLOCKS)
    return worker


@pytest.fixture
def producers(tmp_path, redis_server, no_thread_leak):
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    a, b = _producer(tmp_path, redis_server), _producer(tmp_path, redis_server)
    yield a, b
    for worker in (a, b):
        worker.shutdown()


def test_a_forged_index_entry_never_becomes_a_node_to_load_from(producers, redis_server):
    a, b = producers
    a.start_tasks(PDMeshConnectorMetadata(sends=[named(a, SendTask("p-1", [5, 2], PROMPT[:2 * BLOCK_SIZE]))]))
    assert a.saver.flush(timeout_s=10)
    attacker = redis_server.client()
    for key in block_keys(fingerprint_seed(a.compat), PROMPT, BLOCK_SIZE, b"")[2:4]:
        attacker.hset(a.store.index.key_of(key.block_hash),
                      mapping={"node": ATTACKER, "tier": "dram", "nbytes": BLOCK_NBYTES, "checksum": 0,
                               "last_use": 1.0, "sig": "0" * 64})
    attacker.close()
    lookup = StoreLookup(b.producer.server.address, BLOCK_SIZE, timeout_s=5, auth=MeshAuth(TOKEN))
    assert lookup.nodes_of_cached_prefix(PROMPT, names(b, PROMPT)) == [a.store.index.node] * 2
    lookup.close()
    assert (b.store.index.num_rejected, b.store.index.num_errors) == (2, 0)

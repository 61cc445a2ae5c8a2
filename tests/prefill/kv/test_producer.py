"""A producer that cannot serve undoes what its set-up did: the exporters it made (Mooncake's
registrations of the cache, for one) are closed when its KV port does not bind."""

from __future__ import annotations

import socket

import pytest
import torch

from pdmesh.config import KVTransportSettings, TelemetrySettings
from prefill.kv import shm_exporter
from tests.worker.kv_workers import BLOCK_SIZE, NUM_BLOCKS
from worker.worker_side import ConnectorWorker


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    return tmp_path


def test_a_producer_whose_kv_port_is_taken_closes_the_exporters_it_made(model_dir, no_thread_leak, monkeypatch):
    closed = []
    monkeypatch.setattr(shm_exporter.ShmKVExporter, "close", lambda exporter: closed.append(exporter))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        worker = ConnectorWorker(model=str(model_dir), block_size=BLOCK_SIZE, is_producer=True, kv_host="127.0.0.1",
                                 kv_port=taken.getsockname()[1], hold_timeout_s=60, pull_timeout_s=10,
                                 telemetry=TelemetrySettings(), transport=KVTransportSettings(kv_transport="shm"))
        with pytest.raises(RuntimeError):
            worker.register_kv_caches({"l0": torch.randn(NUM_BLOCKS, 2, BLOCK_SIZE, 16)}, NUM_BLOCKS)
    assert len(closed) == 1 and worker.producer is None
    worker.shutdown()

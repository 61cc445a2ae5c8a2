"""Fixtures of the worker-side tests: a model folder, and a producer-consumer pair per transport."""

from __future__ import annotations

import pytest

from tests.worker.kv_workers import TRANSPORTS, make_worker


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    return tmp_path


@pytest.fixture(params=TRANSPORTS)
def pair(request, model_dir, no_thread_leak):
    producer, consumer = make_worker(model_dir, True, request.param), make_worker(model_dir, False, request.param)
    yield producer, consumer, request.param
    consumer.shutdown()
    producer.shutdown()

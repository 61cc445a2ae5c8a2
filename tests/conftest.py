"""Shared fixtures: the tiny model (built locally, cached) and a leak check for threads."""

from __future__ import annotations

import os
import secrets
import threading
from pathlib import Path

import pytest

from pdmesh.cluster import MESH_TOKEN_ENV
from pdmesh.models.tiny import ensure_deepseek_v2, ensure_llama
from tests.redis_server import RedisServer

# Every local cluster of the session shares this mesh token, so the tests' own calls to a worker carry it.
MESH_TOKEN = os.environ.setdefault(MESH_TOKEN_ENV, secrets.token_urlsafe(24))
TEST_MODELS_DIR = Path(os.environ.get("PDMESH_TEST_MODELS_DIR", Path.home() / ".cache" / "pdmesh" / "test-models"))


@pytest.fixture(scope="session")
def tiny_llama_dir() -> Path:
    return ensure_llama(TEST_MODELS_DIR / "tiny-llama")


@pytest.fixture(scope="session")
def tiny_deepseek_dir() -> Path:
    return ensure_deepseek_v2(TEST_MODELS_DIR / "tiny-deepseek-v2")


@pytest.fixture
def no_thread_leak():
    """Fails a test that leaves a non-daemon thread running (given 2 s to finish its shutdown)."""
    before = {t.ident for t in threading.enumerate()}
    yield
    new = [t for t in threading.enumerate() if t.ident not in before and not t.daemon]
    for thread in new:
        thread.join(timeout=2.0)
    leaked = [t.name for t in new if t.is_alive()]
    assert not leaked, f"threads left running: {leaked}"


@pytest.fixture
def redis_server(tmp_path):
    """A real redis-server with a password, on a free loopback port; stopped after the test."""
    server = RedisServer(tmp_path, password="s3cret").start()
    yield server
    server.stop()

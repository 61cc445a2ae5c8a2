"""Shared fixtures: the tiny model (built locally, cached) and a leak check for threads."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from pdmesh.models.tiny import ensure_llama

TEST_MODEL_DIR = Path(os.environ.get("PDMESH_TEST_MODEL_DIR",
                                     Path.home() / ".cache" / "pdmesh" / "test-models" / "tiny-llama"))


@pytest.fixture(scope="session")
def tiny_llama_dir() -> Path:
    return ensure_llama(TEST_MODEL_DIR)


@pytest.fixture
def no_thread_leak():
    before = {t.ident for t in threading.enumerate()}
    yield
    leaked = [t for t in threading.enumerate() if t.ident not in before and t.is_alive() and not t.daemon]
    assert not leaked, f"threads left running: {[t.name for t in leaked]}"

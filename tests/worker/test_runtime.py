"""A worker refuses to start without a mesh credential (issue 30, item 3): before, with no
--mesh_token and no mTLS, its Prefill/Decode/WorkerInfo port and its KV port served anyone."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pdmesh.config import TlsSettings, WorkerSettings
from worker.runtime import missing_mesh_credential

CLIENT_CA = TlsSettings(cert_file=Path("c.pem"), key_file=Path("k.pem"), ca_file=Path("ca.pem"))


@pytest.mark.parametrize("settings, refused", [
    (WorkerSettings(), True),
    (WorkerSettings(mesh_token="s3cret"), False),
    (WorkerSettings(tls=CLIENT_CA), True),                   # the KV port would still take anyone
    (WorkerSettings(tls=CLIENT_CA, kv_tls=CLIENT_CA), False),
    (WorkerSettings(insecure_no_mesh_auth=True), False),
])
def test_a_worker_needs_a_mesh_credential_on_every_port(settings, refused):
    assert (missing_mesh_credential(settings) is not None) == refused


def test_a_worker_started_without_one_exits_at_once_saying_what_to_set(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDMESH_WORKER_")}
    result = subprocess.run([sys.executable, "-m", "decode", "--port", "0", "--ready_file", str(tmp_path / "ready")],
                            capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 1
    assert "pdmesh decode worker: no mesh credential: set --mesh_token" in result.stderr
    assert not (tmp_path / "ready").exists()

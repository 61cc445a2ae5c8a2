"""Static checks of deploy/docker-compose.yml (no Docker engine runs here): every service's
command parses with the real settings classes and the addresses line up across services."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from pdmesh.config import GatewaySettings, WorkerSettings

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())


def _settings(service: dict):
    python, dash_m, module, *args = service["command"]
    assert (python, dash_m) == ("python", "-m") and importlib.util.find_spec(module) is not None
    cls = GatewaySettings if module == "gateway" else WorkerSettings
    return module, cls.from_cli(args)


def test_services_run_the_three_roles(compose):
    assert sorted(compose["services"]) == ["decode", "gateway", "prefill"]
    assert [_settings(compose["services"][name])[0] for name in ("prefill", "decode", "gateway")] == \
        ["prefill", "decode", "gateway"]


def test_gateway_points_at_the_workers_ports_and_workers_advertise_reachable_kv(compose):
    services = compose["services"]
    _, gateway = _settings(services["gateway"])
    _, prefill = _settings(services["prefill"])
    _, decode = _settings(services["decode"])
    assert gateway.prefill_workers == [f"prefill:{prefill.port}"]
    assert gateway.decode_workers == [f"decode:{decode.port}"]
    assert (prefill.kv_host, prefill.kv_advertise_host) == ("0.0.0.0", "prefill")
    assert prefill.host == decode.host == gateway.host == "0.0.0.0"
    assert services["gateway"]["ports"] == [f"{gateway.port}:{gateway.port}"]


def test_healthcheck_probes_the_worker_port(compose):
    _, prefill = _settings(compose["services"]["prefill"])
    assert compose["services"]["prefill"]["healthcheck"]["test"][-1] == str(prefill.port)


def test_dockerfile_copies_every_package():
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    for package in ("pdmesh", "gateway", "prefill", "decode", "kvstore"):
        assert f"COPY {package} {package}" in dockerfile


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose not installed")
def test_docker_compose_accepts_the_file():
    out = subprocess.run(["docker-compose", "-f", str(DEPLOY / "docker-compose.yml"), "config", "--quiet"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr

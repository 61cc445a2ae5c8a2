"""Static checks of deploy/ (no Docker engine runs here): every pdmesh service's command parses
with the real settings classes, and the addresses line up across services and configs."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from pdmesh.config import GatewaySettings, WorkerSettings
from tests.deploy.rendered import init_compose_secrets

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
PDMESH_SERVICES = ("prefill", "decode", "gateway")
SECRETS_DIR = "/etc/pdmesh/secrets"   # where the services mount the stack's secrets volume


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())


def _settings(service: dict):
    python, dash_m, module, *args = service["entrypoint"] + service["command"]
    assert (python, dash_m) == ("python", "-m") and importlib.util.find_spec(module) is not None
    cls = GatewaySettings if module == "gateway" else WorkerSettings
    return module, cls.from_cli(args)


def test_services_run_the_three_roles_and_the_observability_stack(compose):
    assert sorted(compose["services"]) == ["decode", "gateway", "grafana", "otel-collector", "prefill", "prometheus",
                                           "redis", "secrets-init"]
    assert [_settings(compose["services"][name])[0] for name in PDMESH_SERVICES] == list(PDMESH_SERVICES)


def test_gateway_points_at_the_workers_ports_and_workers_advertise_reachable_kv(compose):
    services = compose["services"]
    _, gateway = _settings(services["gateway"])
    _, prefill = _settings(services["prefill"])
    _, decode = _settings(services["decode"])
    assert gateway.prefill_workers == [f"prefill:{prefill.port}"]
    assert gateway.decode_workers == [f"decode:{decode.port}"]
    assert (prefill.kv_host, prefill.kv_advertise_host) == ("0.0.0.0", "prefill")
    assert prefill.host == decode.host == gateway.host == "0.0.0.0"
    publish_host = "${PDMESH_PUBLISH_HOST:-127.0.0.1}"
    assert services["gateway"]["ports"] == [
        f"{publish_host}:${{PDMESH_GRPC_PORT:-{gateway.port}}}:{gateway.port}",
        f"{publish_host}:${{PDMESH_HTTP_PORT:-{gateway.http_port}}}:{gateway.http_port}"]


def test_workers_register_under_the_names_the_gateway_dials_in_the_redis_service(compose):
    services = compose["services"]
    _, gateway = _settings(services["gateway"])
    for role in ("prefill", "decode"):
        _, worker = _settings(services[role])
        assert (worker.advertise_host, worker.registry.redis_url) == (role, "redis://redis:6379/0")
        assert services[role]["environment"]["PDMESH_WORKER_CONFIG_FILE"] == f"{SECRETS_DIR}/worker.json"
    assert gateway.registry.redis_url == gateway.kv_index_redis_url == "redis://redis:6379/0"
    assert gateway.route_policy == "prefix_aware"


def test_every_process_exports_traces_to_the_collector_and_is_scraped(compose):
    collector = yaml.safe_load((DEPLOY / "otel-collector.yaml").read_text())
    collector_port = collector["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"].rsplit(":", 1)[1]
    targets = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())["scrape_configs"][0]["static_configs"][0]
    for name in PDMESH_SERVICES:
        telemetry = _settings(compose["services"][name])[1].telemetry
        assert (telemetry.exporter, telemetry.otlp_endpoint) == ("otlp", f"otel-collector:{collector_port}")
        assert (telemetry.metrics_host, f"{name}:{telemetry.metrics_port}") == ("0.0.0.0", f"{name}:9400")
        assert f"{name}:{telemetry.metrics_port}" in targets["targets"]


def test_prefill_keeps_its_kv_store_on_a_volume_and_indexes_it_in_the_redis_service(compose):
    services = compose["services"]
    _, prefill = _settings(services["prefill"])
    assert prefill.store.enabled and prefill.store.redis_url == "redis://redis:6379/0"
    assert f"kvstore:{prefill.store.nvme_dir}" in services["prefill"]["volumes"] and "kvstore" in compose["volumes"]


def test_healthcheck_probes_the_worker_port(compose):
    _, prefill = _settings(compose["services"]["prefill"])
    assert compose["services"]["prefill"]["healthcheck"]["test"] == [
        "CMD-SHELL", f"python -m pdmesh.healthcheck {prefill.port}"]


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.gateway", "Dockerfile.cuda", "Dockerfile.ascend"])
def test_dockerfiles_copy_every_package(dockerfile):
    text = (DEPLOY / dockerfile).read_text()
    for package in ("pdmesh", "gateway", "prefill", "decode", "kvstore", "worker"):
        assert f"COPY {package} {package}" in text


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose not installed")
def test_docker_compose_accepts_the_file():
    out = subprocess.run(["docker-compose", "-f", str(DEPLOY / "docker-compose.yml"), "config", "--quiet"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def _merged(variant: str) -> dict:
    """deploy/docker-compose.yml with deploy/docker-compose.<variant>.yml over it, as compose merges them."""
    out = subprocess.run(["docker-compose", "-f", str(DEPLOY / "docker-compose.yml"), "-f",
                          str(DEPLOY / f"docker-compose.{variant}.yml"), "config"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return yaml.safe_load(out.stdout)


def _mounts(service: dict) -> dict[str, str]:
    """container path → host path of each bind mount (long or short syntax)."""
    mounts = {}
    for volume in service.get("volumes", []):
        if isinstance(volume, dict):
            mounts[volume["target"]] = volume["source"]
        else:
            source, target, *_ = volume.split(":")
            mounts[target] = source
    return mounts


@pytest.mark.parametrize("variant", ["cuda", "ascend"])
def test_accelerator_variants_serve_the_mounted_model_with_mooncake_only_where_its_network_is_named(variant, tmp_path,
                                                                                                     monkeypatch):
    services = _merged(variant)["services"]
    assert init_compose_secrets(tmp_path).returncode == 0   # the files the workers' config names
    _, gateway = _settings(services["gateway"])
    assert gateway.tokenizer == "/models/model" and "/models" in _mounts(services["gateway"])
    for role in ("prefill", "decode"):
        service = services[role]
        environment = service["environment"]
        for name in environment:
            if name.startswith("PDMESH_WORKER_"):
                assert name.removeprefix("PDMESH_WORKER_").lower().split("__")[0] in WorkerSettings.model_fields
        assert service["image"] == f"pdmesh-worker:{variant}"
        assert service["build"]["dockerfile"].endswith(f"Dockerfile.{variant}")
        with pytest.MonkeyPatch.context() as env:
            for name, value in environment.items():
                env.setenv(name, str(value).replace(SECRETS_DIR, str(tmp_path)))
            _, worker = _settings(service)
        assert (worker.engine.model, worker.engine.dtype, worker.kv_transport) == ("/models/model", "bfloat16", "auto")
        assert not worker.kv_transport_settings.allows("mooncake")   # its port serves any peer: off by default
        assert "/models" in _mounts(service)
    monkeypatch.setenv("PDMESH_DECODE_MOONCAKE_HOST", "10.9.0.2")   # the operator names the data network
    assert _merged(variant)["services"]["decode"]["environment"]["PDMESH_WORKER_MOONCAKE_HOST"] == "10.9.0.2"


def test_the_cuda_variant_gives_each_worker_its_own_gpu():
    services = _merged("cuda")["services"]
    gpus = []
    for role in ("prefill", "decode"):
        [device] = services[role]["deploy"]["resources"]["reservations"]["devices"]
        assert (device["driver"], device["capabilities"]) == ("nvidia", ["gpu"])
        gpus += device["device_ids"]
    assert sorted(gpus) == ["0", "1"]


def test_the_ascend_variant_passes_its_npu_and_the_drivers_and_keeps_kv_clear_of_hccl():
    services = _merged("ascend")["services"]
    npus = []
    for role in ("prefill", "decode"):
        service = services[role]
        assert str(service["environment"]["ASCEND_RT_VISIBLE_DEVICES"]) == "0"  # its one NPU, as the container sees it
        devices = {d.split(":")[0] if isinstance(d, str) else d["source"] for d in service["devices"]}
        [npu] = [d for d in devices if re.fullmatch(r"/dev/davinci\d+", d)]
        assert devices - {npu} == {"/dev/davinci_manager", "/dev/devmm_svm", "/dev/hisi_hdc"}
        npus.append(npu.removeprefix("/dev/davinci"))
        mounts = _mounts(service)
        for path in ("/usr/local/dcmi", "/usr/local/bin/npu-smi", "/usr/local/Ascend/driver/lib64",
                     "/usr/local/Ascend/driver/version.info", "/etc/ascend_install.info", "/etc/hccn.conf"):
            assert mounts[path] == path
        _, worker = _settings(service)
        if role == "prefill":
            assert 28000 <= worker.kv_port < int(service["environment"]["HCCL_IF_BASE_PORT"])
        assert service["environment"]["PDMESH_WORKER_MOONCAKE_PROTOCOL"] == "ascend"
    assert sorted(npus) == ["0", "1"]


@pytest.mark.parametrize("dockerfile, extra", [("Dockerfile", ".[cpu]"), ("Dockerfile.cuda", ".[cuda]"),
                                               ("Dockerfile.ascend", ".[npu]")])
def test_each_worker_image_installs_its_extra(dockerfile, extra):
    assert f'"{extra}"' in (DEPLOY / dockerfile).read_text()

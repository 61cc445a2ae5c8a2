"""Static checks of deploy/'s compose files as docker-compose merges them (no container engine runs here),
in each layout (workers taking both roles, the default; the static split, docker-compose.split.yml over
it) and variant (CPU; CUDA, Ascend over it): every pdmesh service's command and environment parse with
the real settings classes, and the addresses line up across services and configs."""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

import pytest
import yaml

from pdmesh.config import WorkerSettings
from tests.deploy.rendered import (COMPOSE_STACKS, LAYOUTS, compose_config, compose_process, init_compose_secrets,
                                   settings_of)

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
WORKERS = ("worker-0", "worker-1")
PDMESH_SERVICES = (*WORKERS, "gateway")
MODULES = {"both": {"worker-0": "node", "worker-1": "node", "gateway": "gateway"},
           "split": {"worker-0": "prefill", "worker-1": "decode", "gateway": "gateway"}}
SECRETS_DIR = "/etc/pdmesh/secrets"   # where the services mount the stack's secrets volume


@pytest.fixture(scope="module")
def secrets_dir(tmp_path_factory) -> Path:
    """The files the services' config files name, as the stack's secrets-init service makes them."""
    folder = tmp_path_factory.mktemp("compose") / "secrets"
    assert init_compose_secrets(folder).returncode == 0
    return folder


def _settings(service: dict, secrets_dir: Path):
    """(module, settings) the service's process builds from its flags and its environment alone."""
    module, args = compose_process(service)
    assert importlib.util.find_spec(module) is not None
    with pytest.MonkeyPatch.context() as env:
        for name in [name for name in os.environ if name.startswith("PDMESH_")]:   # this shell's, not the service's
            env.delenv(name)
        for name, value in service.get("environment", {}).items():
            env.setenv(name, str(value).replace(SECRETS_DIR, str(secrets_dir)))
        return module, settings_of(module, args)


def _pdmesh(variant: str, layout: str, secrets_dir: Path, **variables: str) -> dict:
    """service → its settings, for the gateway and the workers."""
    services = compose_config(variant, layout, **variables)["services"]
    return {name: _settings(services[name], secrets_dir)[1] for name in PDMESH_SERVICES}


def _mounts(service: dict) -> dict[str, str]:
    """container path → host path or volume of each mount (long or short syntax)."""
    mounts = {}
    for volume in service.get("volumes", []):
        if isinstance(volume, dict):
            mounts[volume["target"]] = volume["source"]
        else:
            source, target, *_ = volume.split(":")
            mounts[target] = source
    return mounts


@pytest.mark.parametrize("variant, layout", COMPOSE_STACKS)
def test_services_run_the_layouts_modules_and_the_observability_stack(variant, layout, secrets_dir):
    services = compose_config(variant, layout)["services"]
    assert sorted(services) == ["gateway", "grafana", "otel-collector", "prometheus", "redis", "secrets-init",
                                "worker-0", "worker-1"]
    assert {name: _settings(services[name], secrets_dir)[0] for name in PDMESH_SERVICES} == MODULES[layout]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_gateway_places_requests_over_the_workers_under_the_names_they_advertise(layout, secrets_dir):
    config = compose_config("cpu", layout)
    services = config["services"]
    settings = _pdmesh("cpu", layout, secrets_dir)
    gateway, workers = settings["gateway"], [settings[name] for name in WORKERS]
    addresses = [f"{name}:{worker.port}" for name, worker in zip(WORKERS, workers)]
    if layout == "both":   # as `pdmesh up`: workers taking both roles, each request placed over them
        assert (gateway.workers, gateway.prefill_workers, gateway.decode_workers) == (addresses, [], [])
        assert gateway.disagg_policy == "adaptive"
    else:                  # as `pdmesh up --prefill 1 --decode 1`: every prompt on worker-0, every decode on worker-1
        assert (gateway.workers, gateway.prefill_workers, gateway.decode_workers) == ([], addresses[:1], addresses[1:])
        assert gateway.disagg_policy == "remote"
    assert services["gateway"]["depends_on"] == {"secrets-init": {"condition": "service_completed_successfully"},
                                                 **{name: {"condition": "service_healthy"} for name in WORKERS}}
    for name, worker in zip(WORKERS, workers):   # each under its own name: the registry's key, its KV's address
        assert (worker.host, worker.advertise_host, worker.registry.redis_url) == ("0.0.0.0", name,
                                                                                  "redis://redis:6379/0")
        assert (worker.kv_host, worker.kv_advertise_host) == ("0.0.0.0", name)
    assert gateway.host == "0.0.0.0" and gateway.route_policy == "prefix_aware"
    assert gateway.registry.redis_url == gateway.kv_index_redis_url == "redis://redis:6379/0"
    publish_host = "${PDMESH_PUBLISH_HOST:-127.0.0.1}"
    raw = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())["services"]["gateway"]
    assert raw["ports"] == [f"{publish_host}:${{PDMESH_GRPC_PORT:-{gateway.port}}}:{gateway.port}",
                            f"{publish_host}:${{PDMESH_HTTP_PORT:-{gateway.http_port}}}:{gateway.http_port}"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_worker_has_a_core_of_its_own_as_pdmesh_up_places_them(layout, secrets_dir):
    settings = _pdmesh("cpu", layout, secrets_dir)
    cores = [(settings[name].engine.omp_threads_bind, settings[name].process_cpus) for name in WORKERS]
    assert cores == [("0", "0"), ("1", "1")]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_process_exports_traces_to_the_collector_and_is_scraped(layout, secrets_dir):
    collector = yaml.safe_load((DEPLOY / "otel-collector.yaml").read_text())
    collector_port = collector["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"].rsplit(":", 1)[1]
    [scrape] = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())["scrape_configs"]
    [targets] = scrape["static_configs"]
    settings = _pdmesh("cpu", layout, secrets_dir)
    for name in PDMESH_SERVICES:
        telemetry = settings[name].telemetry
        assert (telemetry.exporter, telemetry.otlp_endpoint) == ("otlp", f"otel-collector:{collector_port}")
        assert (telemetry.metrics_host, telemetry.metrics_port) == ("0.0.0.0", 9400)
    assert targets["targets"] == [f"{name}:{settings[name].telemetry.metrics_port}" for name in
                                  ("gateway", *WORKERS)]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_kv_producer_keeps_its_own_store_on_its_own_volume_indexed_in_the_redis_service(layout, secrets_dir):
    config = compose_config("cpu", layout)
    settings = _pdmesh("cpu", layout, secrets_dir)
    volumes = {}
    for name in WORKERS:   # a tier's folder takes one worker (its lock): no two share a volume
        volumes[name] = _mounts(config["services"][name])[str(settings[name].store.nvme_dir)]
    assert volumes == {"worker-0": "kvstore-0", "worker-1": "kvstore-1"}
    assert set(volumes.values()) <= set(config["volumes"])
    producers = [name for name in WORKERS if settings[name].produces]
    assert producers == (list(WORKERS) if layout == "both" else ["worker-0"])
    for name in producers:
        assert settings[name].store.enabled and settings[name].store.redis_url == "redis://redis:6379/0"
        assert settings[name].kv_port == 50062


@pytest.mark.parametrize("layout", LAYOUTS)
def test_healthcheck_probes_each_workers_port(layout, secrets_dir):
    services = compose_config("cpu", layout)["services"]
    settings = _pdmesh("cpu", layout, secrets_dir)
    for name in WORKERS:
        assert services[name]["healthcheck"]["test"] == [
            "CMD-SHELL", f"python -m pdmesh.healthcheck {settings[name].port}"]


def _comparable(service: dict, *but: str) -> dict:
    """The service's configuration but the keys `but`, mounts and ports in any order (a merge reorders them)."""
    return {name: sorted(map(str, value)) if name in ("volumes", "ports") else value
            for name, value in service.items() if name not in but}


def test_the_split_changes_only_the_workers_modules_and_the_gateways_placement():
    for variant in ("cpu", "cuda", "ascend"):
        both, split = compose_config(variant, "both")["services"], compose_config(variant, "split")["services"]
        for name in WORKERS:   # the variant's flags stay: the split replaces the module alone
            assert compose_process(split[name])[1] == compose_process(both[name])[1]
            assert _comparable(split[name], "entrypoint") == _comparable(both[name], "entrypoint")
        changed = {k for k in both["gateway"]["environment"].keys() | split["gateway"]["environment"].keys()
                   if both["gateway"]["environment"].get(k) != split["gateway"]["environment"].get(k)}
        assert changed == {"PDMESH_GATEWAY_WORKERS", "PDMESH_GATEWAY_PREFILL_WORKERS",
                           "PDMESH_GATEWAY_DECODE_WORKERS", "PDMESH_GATEWAY_DISAGG_POLICY"}
        assert _comparable(split["gateway"], "environment") == _comparable(both["gateway"], "environment")
        assert {name: _comparable(service) for name, service in split.items() if name not in PDMESH_SERVICES} == {
            name: _comparable(service) for name, service in both.items() if name not in PDMESH_SERVICES}


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.gateway", "Dockerfile.cuda", "Dockerfile.ascend"])
def test_dockerfiles_copy_every_package(dockerfile):
    text = (DEPLOY / dockerfile).read_text()
    workers = [] if dockerfile == "Dockerfile.gateway" else ["node"]   # python -m node, the workers' module
    for package in ("pdmesh", "gateway", "prefill", "decode", "kvstore", "worker", *workers):
        assert f"COPY {package} {package}" in text


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("variant", ["cuda", "ascend"])
def test_accelerator_variants_serve_the_mounted_model_with_mooncake_only_where_its_network_is_named(
        variant, layout, secrets_dir):
    services = compose_config(variant, layout)["services"]
    settings = _pdmesh(variant, layout, secrets_dir)
    assert settings["gateway"].tokenizer == "/models/model" and "/models" in _mounts(services["gateway"])
    assert [_settings(services[name], secrets_dir)[0] for name in WORKERS] == [MODULES[layout][n] for n in WORKERS]
    for name in WORKERS:
        service, worker = services[name], settings[name]
        for variable in service["environment"]:
            if variable.startswith("PDMESH_WORKER_"):
                assert variable.removeprefix("PDMESH_WORKER_").lower().split("__")[0] in WorkerSettings.model_fields
        assert service["image"] == f"pdmesh-worker:{variant}"
        assert service["build"]["dockerfile"].endswith(f"Dockerfile.{variant}")
        assert (worker.engine.model, worker.engine.dtype, worker.kv_transport) == ("/models/model", "bfloat16", "auto")
        assert not worker.kv_transport_settings.allows("mooncake")   # its port serves any peer: off by default
        assert not worker.mooncake_host
        assert "/models" in _mounts(service)
    named = _pdmesh(variant, layout, secrets_dir, PDMESH_MOONCAKE_HOST_1="10.9.0.2")   # the operator names
    assert [named[name].mooncake_host for name in WORKERS] == ["", "10.9.0.2"]   # its network, for that worker


def test_the_cuda_variant_gives_each_worker_its_own_gpu():
    services = compose_config("cuda")["services"]
    gpus = []
    for name in WORKERS:
        [device] = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert (device["driver"], device["capabilities"]) == ("nvidia", ["gpu"])
        gpus += device["device_ids"]
    assert gpus == ["0", "1"]
    chosen = compose_config("cuda", PDMESH_GPU_0="4", PDMESH_GPU_1="6")["services"]
    assert [chosen[name]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] for name in WORKERS] == [
        ["4"], ["6"]]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_ascend_variant_passes_its_npu_and_the_drivers_and_keeps_kv_clear_of_hccl(layout, secrets_dir):
    services = compose_config("ascend", layout)["services"]
    settings = _pdmesh("ascend", layout, secrets_dir)
    npus = []
    for name in WORKERS:
        service = services[name]
        assert str(service["environment"]["ASCEND_RT_VISIBLE_DEVICES"]) == "0"  # its one NPU, as the container sees it
        devices = {d.split(":")[0] if isinstance(d, str) else d["source"] for d in service["devices"]}
        [npu] = [d for d in devices if re.fullmatch(r"/dev/davinci\d+", d)]
        assert devices - {npu} == {"/dev/davinci_manager", "/dev/devmm_svm", "/dev/hisi_hdc"}
        npus.append(npu.removeprefix("/dev/davinci"))
        mounts = _mounts(service)
        for path in ("/usr/local/dcmi", "/usr/local/bin/npu-smi", "/usr/local/Ascend/driver/lib64",
                     "/usr/local/Ascend/driver/version.info", "/etc/ascend_install.info", "/etc/hccn.conf"):
            assert mounts[path] == path
        if settings[name].produces:
            assert 28000 <= settings[name].kv_port < int(service["environment"]["HCCL_IF_BASE_PORT"])
        assert service["environment"]["PDMESH_WORKER_MOONCAKE_PROTOCOL"] == "ascend"
    assert npus == ["0", "1"]


@pytest.mark.parametrize("dockerfile, extra", [("Dockerfile", ".[cpu]"), ("Dockerfile.cuda", ".[cuda]"),
                                               ("Dockerfile.ascend", ".[npu]")])
def test_each_worker_image_installs_its_extra(dockerfile, extra):
    assert f'"{extra}"' in (DEPLOY / dockerfile).read_text()

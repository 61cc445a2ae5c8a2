"""deploy/k8s rendered with kustomize for each overlay (cpu, cuda, ascend), every object validated
against the real Kubernetes schema (strict: unknown fields are errors), and the wiring checked with
the real settings classes: each pdmesh container's flags and PDMESH_* environment parse into the
addresses of the Services they name, probes ask the gRPC health service on the serving port, and
the accelerator overlays request their devices, mount what their drivers need and keep the KV port
clear of HCCL's."""

from __future__ import annotations

import copy
import re

import kubernetes_validate
import pytest

from pdmesh.config import GatewaySettings, WorkerSettings
from tests.deploy.rendered import OVERLAYS, k8s_objects

KUBERNETES_VERSION = "1.30.0"
POD_IP = "10.1.2.3"
SETTINGS = {"gateway": GatewaySettings, "prefill": WorkerSettings, "decode": WorkerSettings}


@pytest.fixture(params=OVERLAYS)
def rendered(request) -> tuple[str, dict[tuple[str, str], dict]]:
    return request.param, copy.deepcopy(k8s_objects(request.param))


def _container(objects, kind: str, name: str) -> dict:
    [container] = objects[(kind, name)]["spec"]["template"]["spec"]["containers"]
    return container


def _workloads(objects) -> dict[str, dict]:
    """role → its container (gateway, prefill, decode)."""
    return {"gateway": _container(objects, "Deployment", "pdmesh-gateway"),
            "prefill": _container(objects, "StatefulSet", "pdmesh-prefill"),
            "decode": _container(objects, "Deployment", "pdmesh-decode")}


def _environment(container: dict) -> dict[str, str]:
    """The container's env as the kubelet would set it: secrets and the pod IP filled in, $(VAR) expanded
    when VAR comes earlier in the list (a later or unknown one stays as written, as the kubelet leaves it)."""
    env: dict[str, str] = {}
    for var in container.get("env", []):
        if "valueFrom" in var:
            source = var["valueFrom"]
            env[var["name"]] = POD_IP if "fieldRef" in source else f"secret:{source['secretKeyRef']['key']}"
        else:
            env[var["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), var["value"])
    return env


def _settings(role: str, container: dict, monkeypatch):
    for name, value in _environment(container).items():
        monkeypatch.setenv(name, value)
    assert container["command"] == ["python", "-m", role]
    return SETTINGS[role].from_cli(container["args"])


def _field_path_exists(model, path: list[str]) -> bool:
    field = model.model_fields.get(path[0].lower())
    if field is None:
        return False
    if len(path) == 1:
        return True
    return hasattr(field.annotation, "model_fields") and _field_path_exists(field.annotation, path[1:])


def _service_port(objects, service: str, port_name: str) -> int:
    return next(p["port"] for p in objects[("Service", service)]["spec"]["ports"] if p["name"] == port_name)


def test_every_object_validates_against_the_kubernetes_schema(rendered):
    _, objects = rendered
    for (kind, name), doc in objects.items():
        assert kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True), f"{kind}/{name}"
    assert {kind for kind, _ in objects} >= {"Deployment", "StatefulSet", "Service", "ConfigMap", "Secret",
                                            "NetworkPolicy"}


@pytest.mark.parametrize("breakage", ["unknown field", "wrong type"])
def test_the_validator_refuses_a_broken_object(rendered, breakage):
    _, objects = rendered
    broken = copy.deepcopy(objects[("StatefulSet", "pdmesh-prefill")])
    if breakage == "unknown field":
        broken["spec"]["template"]["spec"]["containres"] = broken["spec"]["template"]["spec"].pop("containers")
    else:
        broken["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


def test_every_pdmesh_variable_names_a_real_setting(rendered):
    _, objects = rendered
    for role, container in _workloads(objects).items():
        prefix = "PDMESH_GATEWAY_" if role == "gateway" else "PDMESH_WORKER_"
        for name in _environment(container):
            if name.startswith("PDMESH_"):
                assert name.startswith(prefix), name
                path = name.removeprefix(prefix).split("__")
                assert _field_path_exists(SETTINGS[role], path), f"{role}: {name} sets nothing"


def test_workers_register_their_pod_ip_and_every_address_is_a_service_port(rendered, monkeypatch):
    _, objects = rendered
    containers = _workloads(objects)
    gateway = _settings("gateway", containers["gateway"], monkeypatch)
    redis_url = f"redis://pdmesh-redis:{_service_port(objects, 'pdmesh-redis', 'redis')}/0"
    collector = f"pdmesh-otel-collector:{_service_port(objects, 'pdmesh-otel-collector', 'otlp-grpc')}"
    assert (gateway.prefill_workers, gateway.decode_workers) == ([], [])  # the registry's workers only
    assert gateway.registry.redis_url == gateway.kv_index_redis_url == redis_url
    assert gateway.registry.redis_password == gateway.kv_index_redis_password == "secret:redis-password"
    assert (gateway.port, gateway.http_port) == (_service_port(objects, "pdmesh-gateway", "grpc"),
                                                 _service_port(objects, "pdmesh-gateway", "http"))
    for role in ("prefill", "decode"):
        worker = _settings(role, containers[role], monkeypatch)
        ports = {p["name"]: p["containerPort"] for p in containers[role]["ports"]}
        assert (worker.host, worker.advertise_host, worker.port) == ("0.0.0.0", POD_IP, ports["grpc"])
        assert (worker.registry.redis_url, worker.registry.redis_password) == (redis_url, "secret:redis-password")
        assert worker.mesh_token == gateway.mesh_token == "secret:mesh-token"   # the same secret on every port
        assert worker.engine.model.startswith("/models/")
        for settings in (gateway, worker):
            assert (settings.telemetry.exporter, settings.telemetry.otlp_endpoint) == ("otlp", collector)
            assert (settings.telemetry.metrics_host, settings.telemetry.metrics_port) == ("0.0.0.0", 9400)
        if role == "prefill":
            assert (worker.kv_host, worker.kv_advertise_host, worker.kv_port) == ("0.0.0.0", POD_IP, ports["kv"])
            assert worker.kv_port == _service_port(objects, "pdmesh-prefill", "kv")
            assert worker.store.redis_url == redis_url
            mounts = {m["name"]: m["mountPath"] for m in containers[role]["volumeMounts"]}
            assert str(worker.store.nvme_dir.parent) == mounts["kvstore"]  # on the StatefulSet's own volume
    assert gateway.tokenizer == _environment(containers["prefill"])["PDMESH_WORKER_ENGINE__MODEL"]  # its tokenizer


def test_probes_ask_grpc_health_on_the_serving_port_and_metrics_are_scraped(rendered):
    _, objects = rendered
    for role, container in _workloads(objects).items():
        grpc_port = next(p["containerPort"] for p in container["ports"] if p["name"] == "grpc")
        probes = [container[p] for p in ("startupProbe", "readinessProbe", "livenessProbe") if p in container]
        assert len(probes) == (2 if role == "gateway" else 3)
        assert all(probe["grpc"] == {"port": grpc_port} for probe in probes)
    for name, kind in (("pdmesh-gateway", "Deployment"), ("pdmesh-prefill", "StatefulSet"),
                       ("pdmesh-decode", "Deployment")):
        annotations = objects[(kind, name)]["spec"]["template"]["metadata"]["annotations"]
        assert annotations == {"prometheus.io/scrape": "true", "prometheus.io/port": "9400"}


def test_prefill_and_decode_are_separate_workloads_with_their_own_replicas(rendered):
    _, objects = rendered
    prefill, decode = objects[("StatefulSet", "pdmesh-prefill")], objects[("Deployment", "pdmesh-decode")]
    assert prefill["spec"]["replicas"] == decode["spec"]["replicas"] == 1
    assert [t["metadata"]["name"] for t in prefill["spec"]["volumeClaimTemplates"]] == ["kvstore"]
    secret = next(name for kind, name in objects if kind == "Secret")
    referenced = {var["valueFrom"]["secretKeyRef"]["name"] for c in _workloads(objects).values()
                  for var in c["env"] if "secretKeyRef" in var.get("valueFrom", {})}
    assert referenced == {secret}  # kustomize's hashed name, everywhere


def _limits(container: dict) -> dict:
    return container["resources"]["limits"]


def test_accelerator_overlays_request_their_device_and_pin_whole_cores(rendered):
    overlay, objects = rendered
    device = {"cpu": None, "cuda": "nvidia.com/gpu", "ascend": "huawei.com/Ascend910"}[overlay]
    for role in ("prefill", "decode"):
        container = _workloads(objects)[role]
        assert container["resources"]["requests"] == _limits(container)  # Guaranteed QoS: pinned cores
        assert re.fullmatch(r"\d+", str(_limits(container)["cpu"]))
        assert (_limits(container).get(device) if device else None) == (1 if device else None)


def test_the_ascend_overlay_mounts_the_driver_and_keeps_kv_ports_clear_of_hccl(monkeypatch):
    objects = k8s_objects("ascend")
    for role in ("prefill", "decode"):
        pod = objects[("StatefulSet" if role == "prefill" else "Deployment", f"pdmesh-{role}")]["spec"]["template"]
        container = _workloads(objects)[role]
        host_paths = {v["name"]: v["hostPath"]["path"] for v in pod["spec"]["volumes"] if "hostPath" in v}
        mounts = {m["name"]: (m["mountPath"], m.get("readOnly")) for m in container["volumeMounts"]}
        assert set(host_paths.values()) == {"/usr/local/Ascend/driver", "/usr/local/dcmi", "/usr/local/bin/npu-smi",
                                            "/etc/hccn.conf", "/etc/ascend_install.info"}
        assert all(mounts[name] == (path, True) for name, path in host_paths.items())
        env = _environment(container)
        assert (env["HCCL_IF_IP"], env["PDMESH_WORKER_MOONCAKE_PROTOCOL"]) == (POD_IP, "ascend")
        if role == "prefill":
            kv_port = _settings("prefill", container, monkeypatch).kv_port
            assert 28000 <= kv_port < int(env["HCCL_IF_BASE_PORT"])

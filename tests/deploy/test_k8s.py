"""deploy/k8s rendered with kustomize for each overlay (cpu, cuda, ascend: workers taking both roles;
cpu-split, cuda-split, ascend-split: the role-pinned split on the same nodes), every object validated
against the real Kubernetes schema (strict: unknown fields are errors), and the wiring checked with
the real settings classes: each pdmesh container's flags and PDMESH_* environment parse into the
addresses of the Services they name, probes ask the gRPC health service on the serving port, and
the accelerator overlays request their devices, mount what their drivers need and keep the KV port
clear of HCCL's."""

from __future__ import annotations

import copy
import json
import re

import kubernetes_validate
import pytest

from pdmesh.config import GatewaySettings, WorkerSettings
from tests.deploy.rendered import OVERLAYS, k8s_objects, layout_of, settings_of

KUBERNETES_VERSION = "1.30.0"
POD_IP = "10.1.2.3"
# (kind, name) -> the module its container runs, for each pdmesh workload an overlay may render
WORKLOADS = {("Deployment", "pdmesh-gateway"): "gateway", ("StatefulSet", "pdmesh-worker"): "node",
             ("StatefulSet", "pdmesh-prefill"): "prefill", ("Deployment", "pdmesh-decode"): "decode"}
WORKERS = {"both": ["pdmesh-worker"], "split": ["pdmesh-prefill", "pdmesh-decode"]}   # by layout
SERVICE_OF = {"pdmesh-worker": "pdmesh-worker", "pdmesh-prefill": "pdmesh-prefill"}   # the KV producers' Services


@pytest.fixture(params=OVERLAYS)
def rendered(request) -> tuple[str, dict[tuple[str, str], dict]]:
    return request.param, copy.deepcopy(k8s_objects(request.param))


def _container(objects, kind: str, name: str) -> dict:
    [container] = objects[(kind, name)]["spec"]["template"]["spec"]["containers"]
    return container


def _workloads(objects) -> dict[str, tuple[str, dict]]:
    """name → (module, container) of each pdmesh workload rendered."""
    return {name: (module, _container(objects, kind, name)) for (kind, name), module in WORKLOADS.items()
            if (kind, name) in objects}


def _workers(objects) -> dict[str, tuple[str, dict]]:
    return {name: found for name, found in _workloads(objects).items() if name != "pdmesh-gateway"}


def _kind_of(objects, name: str) -> str:
    [kind] = [kind for kind, found in objects if found == name and kind in ("Deployment", "StatefulSet")]
    return kind


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


def _settings(module: str, container: dict, monkeypatch):
    for name, value in _environment(container).items():
        monkeypatch.setenv(name, value)
    assert container["command"] == ["python", "-m", module]
    return settings_of(module, container["args"])


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
        assert doc["metadata"]["labels"]["app.kubernetes.io/part-of"] == "pdmesh", f"{kind}/{name}"
    assert {kind for kind, _ in objects} >= {"Deployment", "StatefulSet", "Service", "ConfigMap", "Secret",
                                            "NetworkPolicy"}


@pytest.mark.parametrize("breakage", ["unknown field", "wrong type"])
def test_the_validator_refuses_a_broken_object(rendered, breakage):
    _, objects = rendered
    [statefulset] = [doc for (kind, _), doc in objects.items() if kind == "StatefulSet"]
    broken = copy.deepcopy(statefulset)
    if breakage == "unknown field":
        broken["spec"]["template"]["spec"]["containres"] = broken["spec"]["template"]["spec"].pop("containers")
    else:
        broken["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


def test_every_pdmesh_variable_names_a_real_setting(rendered):
    _, objects = rendered
    for name, (module, container) in _workloads(objects).items():
        prefix, settings = (("PDMESH_GATEWAY_", GatewaySettings) if module == "gateway"
                            else ("PDMESH_WORKER_", WorkerSettings))
        for variable in _environment(container):
            if variable.startswith("PDMESH_"):
                assert variable.startswith(prefix), variable
                path = variable.removeprefix(prefix).split("__")
                assert _field_path_exists(settings, path), f"{name}: {variable} sets nothing"


def test_the_layouts_workloads_and_how_the_gateway_places_requests_over_them(rendered, monkeypatch):
    overlay, objects = rendered
    layout = layout_of(overlay)
    assert sorted(_workers(objects)) == sorted(WORKERS[layout])
    others = {name for names in WORKERS.values() for name in names} - set(WORKERS[layout])
    assert not [key for key in objects if key[1] in others]   # nor their Services, NetworkPolicies
    gateway = _settings("gateway", _container(objects, "Deployment", "pdmesh-gateway"), monkeypatch)
    assert gateway.disagg_policy == {"both": "adaptive", "split": "remote"}[layout]
    if layout == "both":   # one pool, each pod its own KV store volume, started together
        worker = objects[("StatefulSet", "pdmesh-worker")]
        assert (worker["spec"]["replicas"], worker["spec"]["podManagementPolicy"]) == (2, "Parallel")
        assert [t["metadata"]["name"] for t in worker["spec"]["volumeClaimTemplates"]] == ["kvstore"]
        assert worker["spec"]["template"]["metadata"]["labels"]["pdmesh.io/role"] == "both"
    else:                  # each role scaled on its own
        prefill, decode = objects[("StatefulSet", "pdmesh-prefill")], objects[("Deployment", "pdmesh-decode")]
        assert prefill["spec"]["replicas"] == decode["spec"]["replicas"] == 1
        assert [t["metadata"]["name"] for t in prefill["spec"]["volumeClaimTemplates"]] == ["kvstore"]
    secret = next(name for kind, name in objects if kind == "Secret")
    referenced = {var["valueFrom"]["secretKeyRef"]["name"] for _, c in _workloads(objects).values()
                  for var in c["env"] if "secretKeyRef" in var.get("valueFrom", {})}
    assert referenced == {secret}  # kustomize's hashed name, everywhere


def test_workers_register_their_pod_ip_and_every_address_is_a_service_port(rendered, monkeypatch):
    _, objects = rendered
    gateway = _settings("gateway", _container(objects, "Deployment", "pdmesh-gateway"), monkeypatch)
    redis_url = f"redis://pdmesh-redis:{_service_port(objects, 'pdmesh-redis', 'redis')}/0"
    collector = f"pdmesh-otel-collector:{_service_port(objects, 'pdmesh-otel-collector', 'otlp-grpc')}"
    assert (gateway.workers, gateway.prefill_workers, gateway.decode_workers) == ([], [], [])  # the registry's only
    assert gateway.registry.redis_url == gateway.kv_index_redis_url == redis_url
    assert gateway.registry.redis_password == gateway.kv_index_redis_password == "secret:redis-password"
    assert (gateway.port, gateway.http_port) == (_service_port(objects, "pdmesh-gateway", "grpc"),
                                                 _service_port(objects, "pdmesh-gateway", "http"))
    producers = []
    for name, (module, container) in _workers(objects).items():
        worker = _settings(module, container, monkeypatch)
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert (worker.host, worker.advertise_host, worker.port) == ("0.0.0.0", POD_IP, ports["grpc"])
        assert (worker.registry.redis_url, worker.registry.redis_password) == (redis_url, "secret:redis-password")
        assert worker.mesh_token == gateway.mesh_token == "secret:mesh-token"   # the same secret on every port
        assert worker.engine.model.startswith("/models/")
        assert gateway.tokenizer == worker.engine.model   # the gateway tokenizes with the served model's
        for settings in (gateway, worker):
            assert (settings.telemetry.exporter, settings.telemetry.otlp_endpoint) == ("otlp", collector)
            assert (settings.telemetry.metrics_host, settings.telemetry.metrics_port) == ("0.0.0.0", 9400)
        if worker.produces:   # its KV port, and its KV store on the StatefulSet's own volume
            producers.append(name)
            assert (worker.kv_host, worker.kv_advertise_host, worker.kv_port) == ("0.0.0.0", POD_IP, ports["kv"])
            assert worker.kv_port == _service_port(objects, SERVICE_OF[name], "kv")
            assert worker.store.redis_url == redis_url
            mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
            assert str(worker.store.nvme_dir.parent) == mounts["kvstore"]
            assert _kind_of(objects, name) == "StatefulSet"
        else:
            assert "kv" not in ports
    assert producers == [name for name in _workers(objects) if name in SERVICE_OF] and producers


def test_probes_ask_grpc_health_on_the_serving_port_and_metrics_are_scraped(rendered):
    _, objects = rendered
    for name, (module, container) in _workloads(objects).items():
        grpc_port = next(p["containerPort"] for p in container["ports"] if p["name"] == "grpc")
        probes = [container[p] for p in ("startupProbe", "readinessProbe", "livenessProbe") if p in container]
        assert len(probes) == (2 if module == "gateway" else 3)
        assert all(probe["grpc"] == {"port": grpc_port} for probe in probes)
        annotations = objects[(_kind_of(objects, name), name)]["spec"]["template"]["metadata"]["annotations"]
        assert annotations == {"prometheus.io/scrape": "true", "prometheus.io/port": "9400"}


def _limits(container: dict) -> dict:
    return container["resources"]["limits"]


def test_accelerator_overlays_request_their_device_and_pin_whole_cores(rendered):
    overlay, objects = rendered
    nodes = overlay.removesuffix("-split")
    device = {"cpu": None, "cuda": "nvidia.com/gpu", "ascend": "huawei.com/Ascend910"}[nodes]
    for _, container in _workers(objects).values():
        assert container["resources"]["requests"] == _limits(container)  # Guaranteed QoS: pinned cores
        assert re.fullmatch(r"\d+", str(_limits(container)["cpu"]))
        assert (_limits(container).get(device) if device else None) == (1 if device else None)


def _as_set(items: list[dict]) -> set[str]:
    return {json.dumps(item, sort_keys=True) for item in items}


@pytest.mark.parametrize("nodes", ["cpu", "cuda", "ascend"])
def test_the_split_runs_on_the_same_nodes_as_the_workers_taking_both_roles(nodes):
    """Each role-pinned worker is configured as the other overlay's worker, less what its role does not
    use (decode: no KV port, no KV store): the accelerator's patches reached it."""
    both, split = k8s_objects(nodes), k8s_objects(f"{nodes}-split")
    [(_, reference)] = _workers(both).values()
    pod = both[("StatefulSet", "pdmesh-worker")]["spec"]["template"]["spec"]
    for name, (_, container) in _workers(split).items():
        assert (container["image"], container["resources"]) == (reference["image"], reference["resources"])
        assert _environment(container).items() <= _environment(reference).items()
        assert _as_set(container["volumeMounts"]) <= _as_set(reference["volumeMounts"])
        assert _as_set(container["ports"]) <= _as_set(reference["ports"])
        split_pod = split[(_kind_of(split, name), name)]["spec"]["template"]["spec"]
        for field in ("nodeSelector", "tolerations", "securityContext"):
            assert split_pod.get(field) == pod.get(field), (name, field)
        assert _as_set(split_pod["volumes"]) <= _as_set(pod["volumes"])


@pytest.mark.parametrize("overlay", ["ascend", "ascend-split"])
def test_the_ascend_overlays_mount_the_driver_and_keep_kv_ports_clear_of_hccl(overlay, monkeypatch):
    objects = k8s_objects(overlay)
    for name, (module, container) in _workers(objects).items():
        pod = objects[(_kind_of(objects, name), name)]["spec"]["template"]
        host_paths = {v["name"]: v["hostPath"]["path"] for v in pod["spec"]["volumes"] if "hostPath" in v}
        mounts = {m["name"]: (m["mountPath"], m.get("readOnly")) for m in container["volumeMounts"]}
        assert set(host_paths.values()) == {"/usr/local/Ascend/driver", "/usr/local/dcmi", "/usr/local/bin/npu-smi",
                                            "/etc/hccn.conf", "/etc/ascend_install.info"}
        assert all(mounts[volume] == (path, True) for volume, path in host_paths.items())
        env = _environment(container)
        assert (env["HCCL_IF_IP"], env["PDMESH_WORKER_MOONCAKE_PROTOCOL"]) == (POD_IP, "ascend")
        worker = _settings(module, container, monkeypatch)
        if worker.produces:   # its KV port moved, in the pod and in its Service alike
            assert 28000 <= worker.kv_port < int(env["HCCL_IF_BASE_PORT"])
            assert worker.kv_port == _service_port(objects, SERVICE_OF[name], "kv")

"""deploy/k8s is secure as rendered (issue 30, item 5): no secret has a default value (the operator
generates them with scripts/gen_secrets.sh, without which nothing renders), every pod runs as a numeric
non-root user with a read-only root filesystem, no capabilities and no privilege escalation, and a
NetworkPolicy selects every pod and lets each role be reached only by the peers it serves."""

from __future__ import annotations

import base64
import json
import os
import re
import stat

import pytest

from tests.deploy.rendered import (DEPLOY, DEV_SECRETS, K8S, OVERLAYS, copy_k8s, generate_secrets, k8s_objects,
                                   k8s_tree, kustomize_build, layout_of)

WORKLOAD_KINDS = ("Deployment", "StatefulSet", "DaemonSet", "Job")
ANYONE = "anyone"
PROMETHEUS = "prometheus pods (any namespace)"
PROMETHEUS_SELECTOR = {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}
WORKERS = {"both": {"worker"}, "split": {"prefill", "decode"}}   # by layout: workloads' names less "pdmesh-"
KV_PRODUCERS = {"worker", "prefill"}


def allowed_ingress(layout: str) -> dict[str, dict[str, set[str]]]:
    """role → its named port → who may open a connection to it. Only the gateway calls a worker's gRPC
    port (moves included); workers read KV (transfers, the KV store) from each other's KV port."""
    workers = WORKERS[layout]
    mesh = {"gateway", *workers}
    return {"gateway": {"grpc": {ANYONE}, "http": {ANYONE}, "metrics": {PROMETHEUS}},
            **{worker: {"grpc": {"gateway"}, **({"kv": workers} if worker in KV_PRODUCERS else {}),
                        "metrics": {PROMETHEUS}} for worker in workers},
            "redis": {"redis": mesh},
            "otel-collector": {"otlp-grpc": mesh}}


def _pods(objects) -> dict[str, dict]:
    """role (app.kubernetes.io/name without "pdmesh-") → its pod template."""
    return {doc["metadata"]["name"].removeprefix("pdmesh-"): doc["spec"]["template"]
            for (kind, _), doc in objects.items() if kind in WORKLOAD_KINDS}


def _secret_values(objects) -> dict[str, str]:
    [secret] = [doc for (kind, _), doc in objects.items() if kind == "Secret"]
    return {key: base64.b64decode(value).decode() for key, value in secret["data"].items()}


def _env_file(path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in path.read_text().splitlines())


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_secret_holds_the_generated_values_and_no_default(overlay):
    values = _secret_values(k8s_objects(overlay))
    assert values == _env_file(k8s_tree() / "base" / "secrets.env")
    assert set(values) == {"redis-password", "mesh-token"}
    assert all(re.fullmatch(r"[0-9a-f]{64}", value) for value in values.values())  # 32 random bytes each
    sources = "".join(path.read_text() for path in K8S.rglob("*.yaml"))
    assert not any(dev in sources for dev in DEV_SECRETS)


def test_nothing_renders_before_the_secrets_are_generated(tmp_path):
    tree = copy_k8s(tmp_path / "k8s")
    refused = kustomize_build(tree / "overlays" / "cpu")
    assert refused.returncode != 0 and "secrets.env" in refused.stderr
    assert generate_secrets(tree / "base" / "secrets.env").returncode == 0
    assert kustomize_build(tree / "overlays" / "cpu").returncode == 0


def test_gen_secrets_makes_private_random_values_once(tmp_path):
    first, second = tmp_path / "a.env", tmp_path / "b.env"
    assert generate_secrets(first).returncode == generate_secrets(second).returncode == 0
    made = _env_file(first)
    assert stat.S_IMODE(os.stat(first).st_mode) == 0o600
    assert set(made.values()).isdisjoint(_env_file(second).values())   # random: another run, other values
    kept = generate_secrets(first)
    assert kept.returncode == 0 and "kept" in kept.stdout and _env_file(first) == made


def _image_user(dockerfile: str) -> int:
    [*_, user] = re.findall(r"^USER (\d+):\d+$", (DEPLOY / dockerfile).read_text(), re.M)
    return int(user)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_pod_runs_non_root_read_only_without_capabilities(overlay):
    pods = _pods(k8s_objects(overlay))
    assert set(pods) == set(allowed_ingress(layout_of(overlay)))
    for role, pod in pods.items():
        spec = pod["spec"]
        context = spec["securityContext"]
        assert context["runAsNonRoot"] is True and context["runAsUser"] > 0, role
        assert context["seccompProfile"] == {"type": "RuntimeDefault"}, role
        for container in spec["containers"] + spec.get("initContainers", []):
            assert container["securityContext"] == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                                    "capabilities": {"drop": ["ALL"]}}, role
    for role in {"gateway", *WORKERS[layout_of(overlay)]}:   # pdmesh's images: their own user, and /tmp writable
        image_user = _image_user("Dockerfile.gateway" if role == "gateway" else "Dockerfile")
        assert pods[role]["spec"]["securityContext"]["runAsUser"] == image_user
        [container] = pods[role]["spec"]["containers"]
        assert "/tmp" in {mount["mountPath"] for mount in container["volumeMounts"]}


def _matches(selector: dict, labels: dict[str, str]) -> bool:
    """Kubernetes' label selector semantics (matchLabels and matchExpressions; {} matches every pod)."""
    if any(labels.get(key) != value for key, value in selector.get("matchLabels", {}).items()):
        return False
    for expression in selector.get("matchExpressions", []):
        key, operator, values = expression["key"], expression["operator"], expression.get("values", [])
        held = {"In": key in labels and labels[key] in values, "NotIn": labels.get(key) not in values,
                "Exists": key in labels, "DoesNotExist": key not in labels}[operator]
        if not held:
            return False
    return True


def _peers(rule: dict, pods: dict[str, dict]) -> set[str]:
    """Who a rule lets in: roles of this namespace, Prometheus's pods, or anyone."""
    if "from" not in rule:
        return {ANYONE}
    peers = set()
    for source in rule["from"]:
        if "namespaceSelector" in source:   # pods of other namespaces too
            peers.add(PROMETHEUS if source.get("podSelector") == PROMETHEUS_SELECTOR else json.dumps(source))
        elif "podSelector" in source:
            peers |= {role for role, pod in pods.items() if _matches(source["podSelector"], pod["metadata"]["labels"])}
        else:
            peers.add(json.dumps(source))   # an ipBlock
    return peers


def _ports(rule: dict, pod: dict) -> list[int | str]:
    """The pod's port numbers a rule opens (named ports resolved); every port where it names none."""
    if "ports" not in rule:
        return ["every port"]
    named = {port["name"]: port["containerPort"] for c in pod["spec"]["containers"] for port in c.get("ports", [])}
    return [named.get(port["port"], port["port"]) for port in rule["ports"]]


def _allowed_ingress(objects, pods: dict[str, dict]) -> dict[str, dict[int | str, set[str]]]:
    """role → port → who may connect, from every NetworkPolicy selecting its pods (None: none selects them)."""
    allowed: dict[str, dict | None] = {role: None for role in pods}
    for (kind, _), policy in objects.items():
        if kind != "NetworkPolicy" or "Ingress" not in policy["spec"].get("policyTypes", ["Ingress"]):
            continue
        for role, pod in pods.items():
            if _matches(policy["spec"]["podSelector"], pod["metadata"]["labels"]):
                ports = allowed[role] = allowed[role] or {}
                for rule in policy["spec"].get("ingress", []):
                    for port in _ports(rule, pod):
                        ports.setdefault(port, set()).update(_peers(rule, pods))
    return allowed


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policies_select_every_pod_and_let_in_only_each_roles_peers(overlay):
    objects = k8s_objects(overlay)
    pods = _pods(objects)
    allowed = _allowed_ingress(objects, pods)
    wanted = allowed_ingress(layout_of(overlay))
    for role, pod in pods.items():
        named = {port["name"]: port["containerPort"] for c in pod["spec"]["containers"] for port in c["ports"]}
        assert allowed[role] == {named[name]: peers for name, peers in wanted[role].items()}, role

"""deploy/'s compose stack is secure as rendered on a fresh host (issue 30, item 5): its secrets are made at
the first start by the secrets-init service (deploy/init_secrets.py, run here for real) and reach every
consumer (a real redis-server started with the stack's command refuses the development password and takes
the one the workers read); published ports listen on 127.0.0.1 unless the operator says otherwise; Grafana
has no anonymous access; every service runs as a numeric non-root user with no capabilities on a
read-only root filesystem, and every image ends on such a user."""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import time
from pathlib import Path

import pytest
import redis
import yaml
from redis.backoff import NoBackoff
from redis.retry import Retry

from tests.deploy.rendered import (COMPOSE_STACKS, DEPLOY, DEV_SECRETS, compose_config, compose_process,
                                   init_compose_secrets, settings_of)
from worker.engine import free_port

INIT_SERVICE = "secrets-init"
SECRETS_VOLUME = "secrets"
SECRET_FILES = {"redis-password", "mesh-token", "grafana-admin-password", "redis.conf", "worker.json",
                "gateway.json"}
DOCKERFILES = sorted([*DEPLOY.glob("Dockerfile*"), *DEPLOY.glob("images/*.Containerfile")])


def _read_secrets(folder: Path) -> dict[str, str]:
    return {name: (folder / name).read_text() for name in ("redis-password", "mesh-token", "grafana-admin-password")}


@pytest.fixture(scope="module")
def compose() -> dict:
    return compose_config("cpu")


@pytest.fixture
def made_secrets(tmp_path) -> Path:
    made = init_compose_secrets(tmp_path / "secrets")
    assert made.returncode == 0, made.stderr
    return tmp_path / "secrets"


def _secrets_target(service: dict) -> str | None:
    """Where the service mounts the stack's secrets volume (read-only), if it does."""
    for volume in service.get("volumes", []):
        source, target, *mode = volume.split(":")
        if source == SECRETS_VOLUME:
            assert mode == ["ro"]
            return target
    return None


def _on_host(value: str, service: dict, secrets_dir: Path) -> str:
    """A value naming a file of the secrets volume, as the path of that file in secrets_dir."""
    target = _secrets_target(service)
    return str(secrets_dir / value.removeprefix(target + "/")) if target and value.startswith(target + "/") else value


def _pdmesh_settings(service: dict, secrets_dir: Path, monkeypatch):
    """The settings a pdmesh service's process builds: its flags and environment, its secrets' files."""
    module, args = compose_process(service)
    for name, value in service.get("environment", {}).items():
        monkeypatch.setenv(name, _on_host(str(value), service, secrets_dir))
    return settings_of(module, args)


def _start_redis(service: dict, secrets_dir: Path, work_dir: Path, port: int, password: str) -> subprocess.Popen:
    """The stack's Redis command, its config file from secrets_dir, on a loopback port of its own."""
    binary, *args = [_on_host(arg, service, secrets_dir) for arg in service["command"]]
    process = subprocess.Popen([shutil.which(binary), *args, "--port", str(port), "--bind", "127.0.0.1", "--dir",
                                str(work_dir)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while True:
        try:
            redis.Redis(host="127.0.0.1", port=port, password=password).ping()
            return process
        except redis.ConnectionError:
            if time.monotonic() > deadline or process.poll() is not None:
                process.kill()
                raise
            time.sleep(0.05)


def test_secrets_init_runs_before_every_service_that_reads_the_secrets(compose):
    services = compose["services"]
    assert services[INIT_SERVICE]["volumes"] == [f"{SECRETS_VOLUME}:/etc/pdmesh/secrets:rw"]
    readers = {name for name, service in services.items() if name != INIT_SERVICE and _secrets_target(service)}
    assert readers == {"worker-0", "worker-1", "gateway", "redis", "grafana"}
    for name in readers:
        assert services[name]["depends_on"][INIT_SERVICE] == {"condition": "service_completed_successfully"}


def test_the_generated_secrets_feed_every_consumer_and_redis_refuses_the_dev_password(compose, made_secrets,
                                                                                       tmp_path, monkeypatch):
    services = compose["services"]
    made = _read_secrets(made_secrets)
    workers = [_pdmesh_settings(services[name], made_secrets, monkeypatch) for name in ("worker-0", "worker-1")]
    gateway = _pdmesh_settings(services["gateway"], made_secrets, monkeypatch)
    assert {worker.mesh_token for worker in workers} == {gateway.mesh_token} == {made["mesh-token"]}
    assert {password for worker in workers for password in (worker.registry.redis_password,
                                                            worker.store.redis_password)} == {
        gateway.registry.redis_password, gateway.kv_index_redis_password} == {made["redis-password"]}
    grafana_env = services["grafana"]["environment"]
    grafana_password = Path(_on_host(grafana_env["GF_SECURITY_ADMIN_PASSWORD__FILE"], services["grafana"],
                                     made_secrets)).read_text()
    assert grafana_password == made["grafana-admin-password"]
    port = free_port("127.0.0.1")
    server = _start_redis(services["redis"], made_secrets, tmp_path, port, gateway.registry.redis_password)
    try:
        assert redis.Redis(host="127.0.0.1", port=port, password=made["redis-password"]).ping()
        for wrong in (None, *DEV_SECRETS):
            with pytest.raises(redis.AuthenticationError):
                redis.Redis(host="127.0.0.1", port=port, password=wrong, retry=Retry(NoBackoff(), 0)).ping()
    finally:
        server.terminate()
        server.wait(timeout=10)


def test_secrets_are_random_private_kept_across_starts_and_never_the_dev_values(made_secrets, tmp_path):
    made = _read_secrets(made_secrets)
    assert {path.name for path in made_secrets.iterdir()} == SECRET_FILES
    assert stat.S_IMODE(os.stat(made_secrets).st_mode) == 0o700
    assert all(stat.S_IMODE(os.stat(path).st_mode) == 0o600 for path in made_secrets.iterdir())
    assert all(len(value) >= 40 and value not in DEV_SECRETS for value in made.values())
    assert len(set(made.values())) == 3
    assert init_compose_secrets(made_secrets).returncode == 0 and _read_secrets(made_secrets) == made   # a restart
    assert init_compose_secrets(tmp_path / "other").returncode == 0
    assert set(_read_secrets(tmp_path / "other").values()).isdisjoint(made.values())
    given = init_compose_secrets(made_secrets, PDMESH_MESH_TOKEN='operator "token"\\')
    assert given.returncode == 0
    assert json.loads((made_secrets / "worker.json").read_text())["mesh_token"] == 'operator "token"\\'
    for dev in DEV_SECRETS:
        refused = init_compose_secrets(tmp_path / dev, PDMESH_REDIS_PASSWORD=dev)
        assert refused.returncode != 0 and "development value" in refused.stderr


@pytest.mark.parametrize("variant, layout", COMPOSE_STACKS)
def test_no_dev_secret_in_the_rendered_stack(variant, layout):
    rendered = yaml.safe_dump(compose_config(variant, layout))
    assert not any(dev in rendered for dev in DEV_SECRETS)
    assert "requirepass" not in rendered   # no password on a command line either


def _published_hosts(config: dict) -> dict[str, list[str]]:
    """service → the host address each of its published ports listens on ("" for every interface)."""
    hosts = {}
    for name, service in config["services"].items():
        for port in service.get("ports", []):
            if isinstance(port, dict):
                hosts.setdefault(name, []).append(port.get("host_ip", ""))
            else:
                parts = str(port).split("/")[0].split(":")
                hosts.setdefault(name, []).append(parts[0] if len(parts) == 3 else "")
    return hosts


@pytest.mark.parametrize("variant, layout", COMPOSE_STACKS)
def test_published_ports_listen_on_loopback_unless_the_operator_says_otherwise(variant, layout):
    by_default = _published_hosts(compose_config(variant, layout))
    assert set(by_default) == {"gateway", "prometheus", "grafana"}
    assert {host for hosts in by_default.values() for host in hosts} == {"127.0.0.1"}
    chosen = _published_hosts(compose_config(variant, layout, PDMESH_PUBLISH_HOST="10.0.0.7"))
    assert {host for hosts in chosen.values() for host in hosts} == {"10.0.0.7"}


def test_grafana_has_no_anonymous_access_and_a_generated_admin_password(compose):
    grafana = compose["services"]["grafana"]
    environment = grafana["environment"]
    assert environment["GF_AUTH_ANONYMOUS_ENABLED"] == "false"
    assert environment["GF_USERS_ALLOW_SIGN_UP"] == "false"
    assert "GF_SECURITY_ADMIN_PASSWORD" not in environment   # only the __FILE form, from the secrets volume
    assert environment["GF_SECURITY_ADMIN_PASSWORD__FILE"] == f"{_secrets_target(grafana)}/grafana-admin-password"


@pytest.mark.parametrize("variant, layout", COMPOSE_STACKS)
def test_every_service_runs_as_a_numeric_non_root_user_without_capabilities(variant, layout):
    for name, service in compose_config(variant, layout)["services"].items():
        user, group = re.fullmatch(r"(\d+):(\d+)", str(service["user"])).groups()
        assert int(user) > 0 and int(group) > 0, name
        assert service["read_only"] is True, name
        assert service["cap_drop"] == ["ALL"] and "cap_add" not in service, name
        assert service["security_opt"] == ["no-new-privileges:true"], name
        assert not service.get("privileged"), name


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda path: path.name)
def test_every_image_ends_on_a_numeric_non_root_user(dockerfile):
    instructions = [line.split()[0] for line in dockerfile.read_text().splitlines() if re.match(r"[A-Z]+\s", line)]
    users = re.findall(r"^USER (\d+):(\d+)$", dockerfile.read_text(), re.M)
    assert users and all(int(part) > 0 for part in users[-1]), "no numeric non-root USER"
    assert "RUN" not in instructions[instructions.index("USER"):], "RUN after USER: its files are root's"


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.gateway", "Dockerfile.cuda", "Dockerfile.ascend"])
def test_the_folders_the_stack_writes_belong_to_the_images_user(dockerfile):
    text = (DEPLOY / dockerfile).read_text()
    [(user, group)] = re.findall(r"^USER (\d+):(\d+)$", text, re.M)
    [owned] = re.findall(rf"install -d -o {user} -g {group} -m 0700 (.+)$", text, re.M)
    wanted = {"/etc/pdmesh/secrets"} | (set() if dockerfile == "Dockerfile.gateway" else {"/var/lib/pdmesh/kvstore"})
    assert set(owned.split()) == wanted

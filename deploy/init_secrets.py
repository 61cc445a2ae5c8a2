"""The compose stack's secrets, made at its first start (the `secrets-init` service runs this before
anything else): the Redis password, the mesh token and Grafana's admin password, each random unless
the operator gives one (PDMESH_REDIS_PASSWORD, PDMESH_MESH_TOKEN, PDMESH_GRAFANA_ADMIN_PASSWORD), kept
in a volume and handed to each consumer in the form it reads:

  redis.conf              requirepass, for `redis-server /etc/pdmesh/secrets/redis.conf`
  worker.json             the workers' config file (PDMESH_WORKER_CONFIG_FILE): mesh token, Redis passwords
  gateway.json            the gateway's config file (PDMESH_GATEWAY_CONFIG_FILE): mesh token, Redis passwords
  grafana-admin-password  Grafana's GF_SECURITY_ADMIN_PASSWORD__FILE

A secret already in the folder is kept (restarts and `up` again keep the mesh's secrets); one the
operator gives replaces it. The development values `pdmesh up` uses are refused. Every file is 0600
and the folder 0700, owned by the user this runs as (the one every service of the stack runs as).

Usage: python init_secrets.py FOLDER     (standard library only: it runs in the gateway image)
"""

from __future__ import annotations

import json
import os
import secrets
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

DEV_VALUES = frozenset({"pdmesh-dev", "pdmesh-dev-mesh"})


@dataclass(frozen=True)
class MeshSecrets:
    redis_password: str
    mesh_token: str
    grafana_admin_password: str


# The secret's file in the folder → the variable an operator gives it in.
OPERATOR_VARIABLES = {"redis-password": "PDMESH_REDIS_PASSWORD", "mesh-token": "PDMESH_MESH_TOKEN",
                      "grafana-admin-password": "PDMESH_GRAFANA_ADMIN_PASSWORD"}


def _write_private(path: Path, text: str) -> None:
    """Atomically, 0600: a service starting meanwhile reads the old file or the new one, never half."""
    with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{path.name}.", delete=False) as tmp:
        os.fchmod(tmp.fileno(), 0o600)
        tmp.write(text)
    os.replace(tmp.name, path)


def _secret(folder: Path, name: str, environ: dict[str, str]) -> str:
    given = environ.get(OPERATOR_VARIABLES[name], "")
    if given in DEV_VALUES:
        raise SystemExit(f"{OPERATOR_VARIABLES[name]} is a development value of `pdmesh up`: choose a secret")
    path = folder / name
    if given:
        _write_private(path, given)
    elif not path.exists():
        _write_private(path, secrets.token_urlsafe(32))
    return path.read_text()


def _redis_conf(password: str) -> str:
    escaped = password.replace("\\", "\\\\").replace('"', '\\"')
    return f'requirepass "{escaped}"\n'


def _worker_config(mesh: MeshSecrets) -> dict:
    return {"mesh_token": mesh.mesh_token, "registry": {"redis_password": mesh.redis_password},
            "store": {"redis_password": mesh.redis_password}}


def _gateway_config(mesh: MeshSecrets) -> dict:
    return {"mesh_token": mesh.mesh_token, "registry": {"redis_password": mesh.redis_password},
            "kv_index_redis_password": mesh.redis_password}


def init_secrets(folder: Path, environ: dict[str, str]) -> MeshSecrets:
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(folder, 0o700)
    mesh = MeshSecrets(redis_password=_secret(folder, "redis-password", environ),
                       mesh_token=_secret(folder, "mesh-token", environ),
                       grafana_admin_password=_secret(folder, "grafana-admin-password", environ))
    _write_private(folder / "redis.conf", _redis_conf(mesh.redis_password))
    _write_private(folder / "worker.json", json.dumps(_worker_config(mesh)))
    _write_private(folder / "gateway.json", json.dumps(_gateway_config(mesh)))
    return mesh


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    init_secrets(Path(sys.argv[1]), dict(os.environ))
    print(f"secrets ready in {sys.argv[1]}")

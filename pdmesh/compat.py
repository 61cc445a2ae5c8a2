"""Model fingerprint and the compatibility check run at every KV handshake."""

from __future__ import annotations

from pathlib import Path

import xxhash

from pdmesh.errors import Incompatible
from pdmesh.v1 import common_pb2
from pdmesh.weights_digest import weights_digest

# Bump when the byte layout of a block on the wire changes, or how blocks are named
# (pdmesh/kv/block_hash.py): the fingerprint seeds every block name and namespaces the Redis index,
# so engines of two versions neither share names nor pass each other's handshake. 2: SHA-256 names;
# 3: a block's checksum is its pieces' (pdmesh/kv/checksum.py) on the gRPC path too.
LAYOUT_VERSION = 3
_SHARED_FIELDS = ("model_fingerprint", "dtype", "block_size", "layout", "num_layers")  # whatever the ranks
_RANK_FIELDS = ("block_nbytes", "num_kv_heads")  # what each rank holds


def model_fingerprint(model_dir: str | Path, dtype: str, block_size: int) -> str:
    """Hex digest over the model's config, its weights' content (weights_digest), dtype, block size and
    layout version: any two engines whose KV could differ for the same tokens differ here."""
    root = Path(model_dir)
    hasher = xxhash.xxh3_128()
    config = root / "config.json"
    hasher.update(config.read_bytes() if config.exists() else str(model_dir).encode())
    hasher.update(f"weights={weights_digest(root)};".encode())
    hasher.update(f"dtype={dtype};block_size={block_size};layout_v={LAYOUT_VERSION}".encode())
    return hasher.hexdigest()


def fingerprint_seed(compat: common_pb2.CompatInfo) -> bytes:
    """Seed for chained block hashes: one hash space per model fingerprint."""
    return compat.model_fingerprint.encode()


def check_compatible(mine: common_pb2.CompatInfo, theirs: common_pb2.CompatInfo) -> None:
    """Raises Incompatible naming every field that differs (same model, same layout, same ranks)."""
    _raise_if_any(_mismatches(mine, theirs))


def check_readable(producer: common_pb2.CompatInfo, consumer: common_pb2.CompatInfo) -> None:
    """A consumer can read the producer's blocks: compatible, or with fewer tensor-parallel ranks
    (tp_ratio) whose caches hold each producer rank's heads as a run of bytes per piece."""
    if producer == consumer:   # the usual mesh: one model, one layout (placement asks for every pair)
        return
    roles = ("prefill", "decode")
    if tp_size(producer) == tp_size(consumer):
        _raise_if_any(_mismatches(producer, consumer, roles))
        return
    diffs = _diffs(producer, consumer, _SHARED_FIELDS, roles)
    ratio = tp_size(producer) // tp_size(consumer)
    heads_fit = (consumer.num_kv_heads == ratio * producer.num_kv_heads
                 and consumer.block_nbytes == ratio * producer.block_nbytes)
    if tp_size(producer) % tp_size(consumer) or not (producer.heads_outer and consumer.heads_outer and heads_fit):
        diffs.append(f"tensor parallel: prefill tp={tp_size(producer)} ({producer.num_kv_heads} KV heads a rank, "
                     f"head-major={producer.heads_outer}), decode tp={tp_size(consumer)} ({consumer.num_kv_heads}, "
                     f"head-major={consumer.heads_outer}): decode can read from k times as many prefill ranks "
                     f"when both keep blocks head-major")
    _raise_if_any(diffs)


def tp_size(compat: common_pb2.CompatInfo) -> int:
    return max(1, compat.tp_size)


def tp_ratio(producer_tp_size: int, consumer_tp_size: int) -> int:
    """How many producer ranks each consumer rank reads from (each holding 1/ratio of its heads)."""
    producer_tp_size, consumer_tp_size = max(1, producer_tp_size), max(1, consumer_tp_size)
    if producer_tp_size % consumer_tp_size:
        raise Incompatible(f"decode with tp={consumer_tp_size} cannot read from prefill with tp={producer_tp_size}: "
                           f"prefill needs a multiple of decode's ranks")
    return producer_tp_size // consumer_tp_size


def _mismatches(mine: common_pb2.CompatInfo, theirs: common_pb2.CompatInfo,
                labels: tuple[str, str] = ("local", "peer")) -> list[str]:
    """Every field that differs between two engines with as many ranks each."""
    diffs = _diffs(mine, theirs, _SHARED_FIELDS + _RANK_FIELDS, labels)
    if tp_size(mine) != tp_size(theirs):
        diffs.append(f"tp_size: {labels[0]}={tp_size(mine)} {labels[1]}={tp_size(theirs)}")
    return diffs


def _raise_if_any(diffs: list[str]) -> None:
    if diffs:
        raise Incompatible("KV layout mismatch between prefill and decode: " + "; ".join(diffs))


def _diffs(mine: common_pb2.CompatInfo, theirs: common_pb2.CompatInfo, names,
           labels: tuple[str, str] = ("local", "peer")) -> list[str]:
    return [f"{name}: {labels[0]}={getattr(mine, name)!r} {labels[1]}={getattr(theirs, name)!r}"
            for name in names if getattr(mine, name) != getattr(theirs, name)]

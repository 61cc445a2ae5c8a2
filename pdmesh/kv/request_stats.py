"""What a request's KV read did, as the worker reports it with the engine's output: a pull from
its producer (PullStats, decode) or a load from the KV store (StoreLoadStats, prefill). One codec
carries either through kv_transfer_params (the dict vLLM returns with the request) and back, so
the servicers read typed fields, never a dict by key."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from pdmesh.kv.params import REQUEST_STATS

PULL, STORE_LOAD = "pull", "store_load"


@dataclass
class PullStats:
    """What a consumer's read of a request's KV from its producer did."""

    num_blocks: int = 0
    num_bytes: int = 0
    seconds: float = 0.0
    first_block_seconds: float = 0.0  # pull start to first verified block: handshake + producer lag
    num_failed_blocks: int = 0
    num_reused_tokens: int = 0   # prompt tokens decode did not compute: local prefix hit + pulled
    num_local_tokens: int = 0    # of those, found in decode's own prefix cache
    transport: str = ""          # what moved the blocks: "shm", "mooncake" or "grpc" ("" when none moved)
    # Layer-wise flow (decode/kv/layerwise_read.py): reading time before prefill's last layer
    # was written and from then until every block was in and verified; the share hidden.
    layerwise: bool = False
    num_layer_reads: int = 0
    seconds_before_prefill_done: float = 0.0
    seconds_after_prefill_done: float = 0.0
    overlap_ratio: float = 0.0


@dataclass
class StoreLoadStats:
    """What a prefill's load of a prompt's cached blocks from the KV store did."""

    tokens_by_tier: dict[str, int] = field(default_factory=dict)  # prompt tokens loaded, by where from
    num_local_tokens: int = 0    # prompt tokens the engine's own prefix cache had (not loaded)
    num_blocks: int = 0
    num_failed_blocks: int = 0   # planned but not loaded (missing, corrupt, peer gone): computed instead
    num_bytes: int = 0
    seconds: float = 0.0
    budget_s: float = 0.0        # the load's time budget: what computing its tokens would cost
    cut: bool = False            # stopped at the budget (the rest was computed)
    transport: str = ""          # what moved the blocks from another node's store ("" when none did)


RequestStats = PullStats | StoreLoadStats


def encode_stats(stats: RequestStats) -> dict[str, Any]:
    """The stats as plain values (they cross vLLM's processes in its messages), with their kind."""
    return {"kind": PULL if isinstance(stats, PullStats) else STORE_LOAD, **asdict(stats)}


def decode_stats(values: dict[str, Any]) -> RequestStats:
    kind = PullStats if values.get("kind") == PULL else StoreLoadStats
    names = {f.name for f in fields(kind)}
    return kind(**{name: value for name, value in values.items() if name in names})


def pull_stats(kv_params: dict[str, Any] | None) -> PullStats | None:
    """What a decode request's pull did, if the request pulled."""
    stats = _stats_of(kv_params)
    return stats if isinstance(stats, PullStats) else None


def store_load_stats(kv_params: dict[str, Any] | None) -> StoreLoadStats | None:
    """What a prefill request's store load did, if it loaded."""
    stats = _stats_of(kv_params)
    return stats if isinstance(stats, StoreLoadStats) else None


def _stats_of(kv_params: dict[str, Any] | None) -> RequestStats | None:
    values = (kv_params or {}).get(REQUEST_STATS)
    return decode_stats(values) if values else None

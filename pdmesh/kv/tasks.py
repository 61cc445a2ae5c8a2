"""Typed per-step tasks the connector's scheduler side hands its worker side: what to hold,
read, load from the store, or read layer by layer (no vLLM types: the halves and the store use them)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SendTask:
    """Producer: blocks of a finished prefill to pin until the consumer releases them."""

    transfer_id: str       # minted by the scheduler side: the consumer's capability to read and free the blocks
    block_ids: list[int]
    token_ids: list[int]   # the tokens the blocks hold, for content hashes
    extra_key: bytes = b""  # the request's cache salt: part of the store's block hashes
    pdmesh_request_id: str = ""
    trace_carrier: dict[str, str] = field(default_factory=dict)  # parent of the kvstore.save span
    engine_request_id: str = ""  # reported finished sending under it ("": the transfer id)
    # The blocks' chained content hashes (with the cache salt; the partial last block too): the
    # request's, hashed once by the scheduler side (worker/prompt_hashes.py); the transfer and the
    # store's keys both use them.
    block_hashes: list[bytes] = field(default_factory=list)


@dataclass
class RecvTask:
    """Consumer: blocks to pull into local blocks, then release on the producer."""

    request_id: str          # engine-internal id, reported back through get_finished
    pdmesh_request_id: str   # mesh-wide id, keys the transfer stats
    transfer_id: str
    kv_address: str
    block_indexes: list[int]     # positions in the producer's block list
    local_block_ids: list[int]   # where each of them goes, aligned with block_indexes
    token_ids: list[int]         # the prompt tokens the remote KV covers (pulled blocks must hold them)
    block_hashes: list[bytes] = field(default_factory=list)  # theirs, chained (the partial last block too)
    num_local_tokens: int = 0    # prompt tokens already in the local prefix cache
    report_done: bool = True     # False: release-only (nothing is waiting on it)
    extra_key: bytes = b""       # the request's cache salt: part of its blocks' content hashes
    trace_carrier: dict[str, str] = field(default_factory=dict)  # parent of the kv.transfer span
    producer_tp_size: int = 1    # the producer's ranks (each serves its heads on kv_address's port + rank)
    layerwise: bool = False      # the producer is still prefilling: read each layer as it is written


@dataclass
class StoreLoadTask:
    """Producer with a KV store: blocks of the prompt to load from the store (local tiers or
    another node's) instead of computing them."""

    request_id: str
    pdmesh_request_id: str
    token_ids: list[int]          # the prompt's tokens up to the end of the last block to load
    extra_key: bytes
    block_hashes: list[bytes]     # the chained hashes of token_ids' blocks (the request's, hashed once)
    block_indexes: list[int]      # block positions in the prompt to load
    local_block_ids: list[int]    # where each goes, aligned with block_indexes
    nodes: list[str]              # where each comes from ("" = this node), aligned with block_indexes
    num_local_tokens: int = 0     # prompt tokens the engine's own prefix cache already had
    trace_carrier: dict[str, str] = field(default_factory=dict)
    budget_s: float = float("inf")  # the load is cut once it has taken this long (the rest is computed)


@dataclass
class LayerwiseStep:
    """Producer, layer-wise flow: this step computes tokens [num_tokens_before, num_tokens_after)
    of a prompt whose KV a consumer reads as each layer is written."""

    transfer_id: str
    pdmesh_request_id: str
    block_ids: list[int]    # the request's blocks so far, in token order
    num_tokens_before: int
    num_tokens_after: int
    # The step that completes the prompt carries its blocks' chained hashes: once the step is done
    # the producer publishes them and the blocks' checksums, before the request is held.
    block_hashes: list[bytes] | None = None

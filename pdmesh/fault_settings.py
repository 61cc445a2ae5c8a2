"""The fault injection a worker takes from its settings (`--kv_faults.*`): tests and the fault campaign only."""

from __future__ import annotations

from pydantic import BaseModel, Field


class KVFaultSettings(BaseModel):
    """Fault injection for the tests and the fault benchmark; both empty (off) in any real deployment.
    A decode request whose mesh request id starts with `tamper_request_prefix` gets its pulled KV
    overwritten between producer and consumer; with `unverified_request_prefix`, the checksum of its
    landed KV is not checked (the control that shows what the check catches)."""

    tamper_request_prefix: str = ""
    unverified_request_prefix: str = ""
    # Requests whose mesh id starts with this pause `stall_s` in the middle of their KV read (after
    # opening it; after the first message on gRPC): the window the fault tests kill a peer in.
    stall_request_prefix: str = ""
    stall_s: float = 0.0
    # Prefill, layer-wise flow: each engine step computing such a request's prompt takes slow_step_s
    # longer (the window the fault tests kill or stop a worker in, mid-prefill).
    slow_prefill_request_prefix: str = ""
    slow_step_s: float = 0.0
    # The KV store's tiers of these names ("device", "dram", "nvme") keep every block written into
    # them with one bit flipped (kvstore/rotting_tier.py): the store must detect, drop and count it.
    rot_store_tiers: list[str] = Field(default_factory=list)

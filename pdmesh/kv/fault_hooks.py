"""Where the tests and the fault campaign reach into the KV path. The producer, the consumer and
the KV store take a KVFaultHooks and ask it at each such point; the default (NO_FAULTS) changes
nothing. A worker builds its hooks from its --kv_faults.* settings (worker/fault_injection.py),
which every real deployment leaves empty."""

from __future__ import annotations

from collections.abc import Iterable

from pdmesh.transport.kv_transport import ReadOptions


class KVFaultHooks:
    def step_delay_s(self, request_ids: Iterable[str]) -> float:
        """Producer: seconds an engine step computing these requests' prompts takes longer."""
        return 0.0

    def read_options(self, request_id: str) -> ReadOptions:
        """Consumer: how the read of this request's KV treats its bytes (tampered, unverified, stalled)."""
        return ReadOptions()

    def store_tier(self, tier, index: int, num_tiers: int, block_nbytes: int):
        """KV store: the tier as the store uses it (one that rots what it keeps, for instance)."""
        return tier


NO_FAULTS = KVFaultHooks()

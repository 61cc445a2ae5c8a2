"""The fault hooks a worker's --kv_faults.* settings ask for (pdmesh/config.py KVFaultSettings):
the tests' and the fault campaign's way into a real worker process. Every field empty: NO_FAULTS."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from kvstore.rotting_tier import RottingTier
from pdmesh.fault_settings import KVFaultSettings
from pdmesh.kv.fault_hooks import NO_FAULTS, KVFaultHooks
from pdmesh.transport.kv_transport import ReadOptions


def fault_hooks(faults: KVFaultSettings) -> KVFaultHooks:
    return NO_FAULTS if faults == KVFaultSettings() else SettingsFaultHooks(faults)


class SettingsFaultHooks(KVFaultHooks):
    def __init__(self, faults: KVFaultSettings) -> None:
        self._faults = faults

    def step_delay_s(self, request_ids: Iterable[str]) -> float:
        """A slow prefill, to stop or kill a worker mid-way (the layer-wise flow's fault tests)."""
        slow = self._faults.slow_prefill_request_prefix
        return self._faults.slow_step_s if slow and any(rid.startswith(slow) for rid in request_ids) else 0.0

    def read_options(self, request_id: str) -> ReadOptions:
        faults = self._faults
        tamper = _starts(request_id, faults.tamper_request_prefix)
        unverified = _starts(request_id, faults.unverified_request_prefix)
        stall = _starts(request_id, faults.stall_request_prefix)
        return ReadOptions(verify=not unverified, tamper=_overwrite if tamper else None,
                           stall_s=faults.stall_s if stall else 0.0)

    def store_tier(self, tier, index: int, num_tiers: int, block_nbytes: int):
        """A tier named in rot_store_tiers keeps every block with one bit flipped (each such tier at a
        byte of its own, so a block demoted from one into the next is not flipped back)."""
        if tier.name not in self._faults.rot_store_tiers:
            return tier
        return RottingTier(tier, (index + 1) * block_nbytes // (num_tiers + 1))


def _starts(request_id: str, prefix: str) -> bool:
    return bool(prefix) and request_id.startswith(prefix)


def _overwrite(buffer) -> None:
    """The fault tests' tamper: KV bytes replaced between producer and consumer."""
    np.asarray(buffer, dtype=np.uint8)[...] = 0x40

"""A worker's --kv_faults.* settings become the hooks its producer, consumer and KV store call;
empty settings are no hooks at all."""

from __future__ import annotations

import numpy as np

from kvstore.rotting_tier import RottingTier
from kvstore.store_agent import build_tiers
from pdmesh.config import KVFaultSettings, StoreSettings
from pdmesh.kv.fault_hooks import NO_FAULTS
from pdmesh.transport.kv_transport import ReadOptions
from tests.kvstore.factories import BLOCK_NBYTES
from worker.fault_injection import fault_hooks

FAULTS = KVFaultSettings(tamper_request_prefix="tamper-", unverified_request_prefix="tamper-unverified-",
                         stall_request_prefix="stall-", stall_s=2.5, slow_prefill_request_prefix="slow-",
                         slow_step_s=0.3)


def test_empty_settings_are_no_hooks():
    assert fault_hooks(KVFaultSettings()) is NO_FAULTS


def test_reads_are_tampered_unverified_or_stalled_by_their_request_ids_prefix():
    hooks = fault_hooks(FAULTS)
    assert hooks.read_options("mesh-1") == ReadOptions()
    tampered = hooks.read_options("tamper-1")
    buffer = np.zeros(8, dtype=np.uint8)
    tampered.tamper(buffer)
    assert tampered.verify and buffer.tolist() == [0x40] * 8
    assert not hooks.read_options("tamper-unverified-1").verify
    assert hooks.read_options("stall-1").stall_s == 2.5


def test_a_step_computing_a_slow_prefill_is_delayed():
    hooks = fault_hooks(FAULTS)
    assert (hooks.step_delay_s(["a", "slow-1"]), hooks.step_delay_s(["a"]), NO_FAULTS.step_delay_s(["slow-1"])) == (
        0.3, 0.0, 0.0)


def test_the_store_settings_rot_only_the_tiers_named(tmp_path):
    settings = StoreSettings(device_bytes=2 * BLOCK_NBYTES, dram_bytes=2 * BLOCK_NBYTES, nvme_dir=str(tmp_path),
                             nvme_bytes=2 * BLOCK_NBYTES)
    tiers = build_tiers(settings, BLOCK_NBYTES, "cpu", fault_hooks(KVFaultSettings(rot_store_tiers=["dram"])))
    assert [(t.name, isinstance(t, RottingTier)) for t in tiers] == [("device", False), ("dram", True),
                                                                    ("nvme", False)]
    tiers[-1].close()   # frees the NVMe directory for the next tiers
    assert all(not isinstance(t, RottingTier) for t in build_tiers(settings, BLOCK_NBYTES, "cpu"))

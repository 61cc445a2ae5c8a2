"""The fault tests' rotting tier (kvstore/rotting_tier.py) on the real tiers: a block kept in a
rotting device or DRAM tier reads as corrupt, is dropped and counted by the tier that held it,
whether it was written there or demoted into it; the other tiers are untouched."""

from __future__ import annotations

from kvstore.block_store import TieredBlockStore
from kvstore.disk_tier import DiskTier
from kvstore.rotting_tier import RottingTier
from kvstore.slab_tier import device_tier, host_tier
from tests.kvstore.factories import BLOCK_NBYTES, keys, payload


def _store(tmp_path, rotting: set[str]) -> TieredBlockStore:
    tiers = [device_tier(2 * BLOCK_NBYTES, BLOCK_NBYTES), host_tier(2 * BLOCK_NBYTES, BLOCK_NBYTES),
             DiskTier(tmp_path, 2 * BLOCK_NBYTES, BLOCK_NBYTES)]
    return TieredBlockStore([RottingTier(t, 8 * (i + 1)) if t.name in rotting else t for i, t in enumerate(tiers)],
                            BLOCK_NBYTES)


def test_a_block_rotting_in_device_memory_is_a_counted_miss_and_dropped(tmp_path):
    store = _store(tmp_path, {"device"})
    k = keys(1)
    store.put(k[0], payload(3))
    assert store.read(k[0]) is None
    assert (store.corrupt, store.tier_of(k[0].block_hash), store.longest_prefix(k)) == ({"device": 1}, None, 0)


def test_a_block_demoted_into_rotting_dram_is_caught_there(tmp_path):
    store = _store(tmp_path, {"device", "dram"})   # rotten twice, at distinct bytes: still rotten
    k = keys(2)
    for i, key in enumerate(k):
        store.put(key, payload(i))
    assert store.spill("dram") == 2
    assert store.read_prefix(k)[1] == []
    assert store.corrupt == {"dram": 2}


def test_blocks_in_the_tiers_that_do_not_rot_read_back_whole(tmp_path):
    store = _store(tmp_path, {"dram"})
    k = keys(2)
    store.put(k[0], payload(1))
    assert bytes(store.read(k[0])[0]) == payload(1)        # device
    store.put(k[1], payload(2))
    assert store.spill("nvme") == 2
    assert [bytes(row) for row in store.read_prefix(k)[0]] == [payload(1), payload(2)]   # from NVMe
    assert not store.corrupt

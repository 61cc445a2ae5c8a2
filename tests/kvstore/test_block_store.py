"""Placement, eviction order, promotion, pinning and integrity of the tiered store (device tier of
2 blocks, DRAM 2, NVMe 2, so every move is visible)."""

import threading

import numpy as np

from kvstore.block_store import TieredBlockStore
from kvstore.disk_tier import JOURNAL_NAME, find_block, replay_journal
from kvstore.slab_tier import host_tier
from kvstore.store_events import BlockDropped, BlockPlaced
from tests.kvstore.factories import BLOCK_NBYTES, flip_bit, keys, payload, three_tier_store


class _Recorder:
    def __init__(self) -> None:
        self.events = []

    def on_events(self, events):
        self.events += events


def _layout(store):
    return {tier: store.blocks_in(tier) for tier in store.tier_names}


def test_full_tiers_demote_their_least_recently_used_block_down_the_chain(tmp_path):
    store = three_tier_store(tmp_path)
    k = keys(7)
    for i, key in enumerate(k[:6]):
        assert store.put(key, payload(i))
    h = [key.block_hash for key in k]
    assert _layout(store) == {"device": [h[4], h[5]], "dram": [h[2], h[3]], "nvme": [h[0], h[1]]}
    assert store.occupancy_bytes() == {"device": 2 * BLOCK_NBYTES, "dram": 2 * BLOCK_NBYTES, "nvme": 2 * BLOCK_NBYTES}
    assert store.put(k[6], payload(6))
    assert _layout(store) == {"device": [h[5], h[6]], "dram": [h[3], h[4]], "nvme": [h[1], h[2]]}
    assert (store.num_blocks, store.num_dropped) == (6, 1)
    on_disk = replay_journal(tmp_path / JOURNAL_NAME, BLOCK_NBYTES, capacity_blocks=2)
    assert sorted(entry.key.block_hash for entry in on_disk.values()) == sorted([h[1], h[2]])


def test_a_lookup_touches_tails_first_so_a_prefix_loses_its_end_before_its_start():
    store = TieredBlockStore([host_tier(3 * BLOCK_NBYTES, BLOCK_NBYTES)], BLOCK_NBYTES)
    prefix, other = keys(3), keys(1, first_token=1000)
    for i, key in enumerate(prefix):
        store.put(key, payload(i))
    assert store.longest_prefix(prefix) == 3
    store.put(other[0], payload(9))  # evicts the prefix's tail, not its head
    assert store.longest_prefix(prefix) == 2
    assert store.blocks_in("dram") == [other[0].block_hash, prefix[1].block_hash, prefix[0].block_hash]


def test_a_put_and_a_read_touch_tails_first_too():
    """A prefix saved or read in one batch keeps its head longest (the head in the newest place)."""
    prefix, other = keys(3), keys(2, first_token=1000)
    saved = TieredBlockStore([host_tier(3 * BLOCK_NBYTES, BLOCK_NBYTES)], BLOCK_NBYTES)
    saved.put_many(prefix, _rows(0, 3))
    saved.put(other[0], payload(9))  # evicts the prefix's tail, not its head
    assert saved.longest_prefix(prefix) == 2
    read = TieredBlockStore([host_tier(3 * BLOCK_NBYTES, BLOCK_NBYTES)], BLOCK_NBYTES)
    for i in (2, 1, 0):
        read.put(prefix[i], payload(i))
    assert len(read.read_prefix(prefix)[1]) == 3
    read.put(other[0], payload(9))
    assert read.longest_prefix(prefix) == 2


def test_a_hit_in_a_lower_tier_is_verified_and_promoted(tmp_path):
    store = three_tier_store(tmp_path)
    k = keys(6)
    for i, key in enumerate(k):
        store.put(key, payload(i))
    payload_read, tier = store.read(k[0])
    assert (bytes(payload_read), tier) == (payload(0), "nvme")
    h = [key.block_hash for key in k]
    assert _layout(store) == {"device": [h[5], h[0]], "dram": [h[3], h[4]], "nvme": [h[1], h[2]]}
    assert store.hits == {"nvme": 1}


def test_longest_prefix_stops_at_the_first_gap_and_checks_the_guard():
    store = TieredBlockStore([host_tier(8 * BLOCK_NBYTES, BLOCK_NBYTES)], BLOCK_NBYTES)
    k = keys(4)
    for i in (0, 1, 3):
        store.put(k[i], payload(i))
    assert store.longest_prefix(k) == 2
    forged = type(k[0])(k[0].block_hash, k[0].parent_hash, (9, 9, 9, 9))  # same hash, other tokens
    assert store.longest_prefix([forged]) == 0
    assert store.read(forged) is None
    assert not store.put(forged, payload(7))  # a collision never overwrites the stored block


def test_a_bit_flipped_on_nvme_is_a_counted_miss_and_the_block_is_dropped(tmp_path):
    recorder = _Recorder()
    store = three_tier_store(tmp_path, listener=recorder)
    k = keys(5)
    for i, key in enumerate(k):
        store.put(key, payload(i))
    path, offset = find_block(tmp_path, k[0].block_hash, BLOCK_NBYTES)
    flip_bit(path, offset + BLOCK_NBYTES - 1)
    assert store.read(k[0]) is None
    assert (store.corrupt, store.tier_of(k[0].block_hash)) == ({"nvme": 1}, None)
    assert find_block(tmp_path, k[0].block_hash, BLOCK_NBYTES) is None  # its slot's free record is journaled
    assert recorder.events[-1] == BlockDropped(k[0].block_hash)
    assert store.longest_prefix(k) == 0


def test_a_block_being_read_is_never_evicted_under_its_reader():
    store = TieredBlockStore([host_tier(1 * BLOCK_NBYTES, BLOCK_NBYTES)], BLOCK_NBYTES)
    a, b = keys(2)
    store.put(a, payload(1))
    started, release = threading.Event(), threading.Event()
    tier = store._tiers[0]
    real_read = tier.read_many

    def slow_read(handles, out):
        started.set()
        release.wait(5)
        return real_read(handles, out)

    tier.read_many = slow_read
    reader = threading.Thread(target=lambda: result.append(store.read(a)))
    result = []
    reader.start()
    started.wait(5)
    assert store.put(b, payload(2)) is False  # the only slot is pinned: out of space, not an error
    release.set()
    reader.join(5)
    assert bytes(result[0][0]) == payload(1)
    tier.read_many = real_read
    assert store.put(b, payload(2)) is True  # unpinned now: a is evicted
    assert store.tier_of(a.block_hash) is None


def test_spill_forces_blocks_down_and_events_name_each_placement(tmp_path):
    recorder = _Recorder()
    store = three_tier_store(tmp_path, device_blocks=2, dram_blocks=2, nvme_blocks=4, listener=recorder)
    k = keys(2)
    for i, key in enumerate(k):
        store.put(key, payload(i))
    assert store.spill("nvme") == 2
    assert _layout(store) == {"device": [], "dram": [], "nvme": [k[0].block_hash, k[1].block_hash]}
    placed = [(e.block_hash, e.tier) for e in recorder.events if isinstance(e, BlockPlaced)]
    assert placed[-2:] == [(k[0].block_hash, "nvme"), (k[1].block_hash, "nvme")]
    assert bytes(store.read(k[1])[0]) == payload(1)


def test_nvme_blocks_are_found_again_after_a_restart(tmp_path):
    store = three_tier_store(tmp_path, nvme_blocks=4)
    k = keys(2)
    for i, key in enumerate(k):
        store.put(key, payload(i))
    store.spill("nvme")
    store.close()
    restarted = three_tier_store(tmp_path, nvme_blocks=4)
    assert restarted.longest_prefix(k) == 2
    assert bytes(restarted.read(k[0])[0]) == payload(0)


def _rows(first, count):
    return np.stack([np.frombuffer(payload(i), dtype=np.uint8) for i in range(first, first + count)])


def test_put_many_and_read_prefix_move_a_batch_and_stop_at_the_first_gap(tmp_path):
    store = three_tier_store(tmp_path, device_blocks=4, dram_blocks=4, nvme_blocks=4)
    k = keys(6)
    assert store.put_many(k[:4], _rows(0, 4)) == 4
    assert store.put_many(k[2:6], _rows(2, 4)) == 4  # two held already, two new: device's LRU two move down
    h = [key.block_hash for key in k]
    assert _layout(store) == {"device": [h[5], h[4], h[3], h[2]], "dram": [h[1], h[0]], "nvme": []}  # tails oldest
    store.clear()
    store.put_many(k[:3], _rows(0, 3))
    store.spill("nvme")
    store.put_many(k[4:5], _rows(4, 1))
    rows, tiers = store.read_prefix(k)
    assert (tiers, [bytes(row) for row in rows]) == (["nvme"] * 3, [payload(i) for i in range(3)])
    assert store.hits == {"nvme": 3}
    assert _layout(store)["device"] == [h[4], h[2], h[1], h[0]]  # hits promoted together, tail first


def test_put_many_stops_when_every_slot_is_pinned():
    store = TieredBlockStore([host_tier(2 * BLOCK_NBYTES, BLOCK_NBYTES)], BLOCK_NBYTES)
    k = keys(3)
    store.put_many(k[:1], _rows(0, 1))
    store._entries[k[0].block_hash].num_readers += 1  # a reader holds it
    assert store.put_many(k, _rows(0, 3)) == 2  # k[0] held, k[1] placed, no room for k[2]
    assert store.longest_prefix(k) == 2


def test_disk_writes_run_outside_the_lock_and_a_pending_block_reads_from_memory(tmp_path):
    store = three_tier_store(tmp_path, device_blocks=1, dram_blocks=1, nvme_blocks=4)
    disk = store._tiers[2]
    writing, release = threading.Event(), threading.Event()
    real_write = disk.write_many

    def slow_write(*args):
        writing.set()
        release.wait(5)
        return real_write(*args)

    disk.write_many = slow_write
    k = keys(3)
    store.put_many(k[:2], _rows(0, 2))
    putter = threading.Thread(target=store.put, args=(k[2], payload(2)))  # demotes k[0] to the disk
    putter.start()
    assert writing.wait(5)
    assert store.longest_prefix(k) == 3  # the lock is free while the disk writes
    assert store.tier_of(k[0].block_hash) == "nvme" and store.num_pinned == 1
    assert bytes(store.read(k[0])[0]) == payload(0)  # from the rows in hand; pinned, so not promoted
    release.set()
    putter.join(5)
    disk.write_many = real_write
    assert (store.num_pinned, store.tier_of(k[0].block_hash)) == (0, "nvme")
    assert bytes(store.read(k[0])[0]) == payload(0)


def test_a_failed_disk_write_drops_its_blocks(tmp_path):
    recorder = _Recorder()
    store = three_tier_store(tmp_path, device_blocks=1, dram_blocks=1, nvme_blocks=4, listener=recorder)
    disk = store._tiers[2]

    def full_disk(*args):
        raise OSError(28, "No space left on device")

    disk.write_many = full_disk
    k = keys(3)
    for i, key in enumerate(k):
        assert store.put(key, payload(i))
    assert (store.tier_of(k[0].block_hash), store.num_pinned, store.num_dropped) == (None, 0, 1)
    assert recorder.events[-1] == BlockDropped(k[0].block_hash)
    assert store.longest_prefix(k[1:]) == 2


def test_a_full_disk_fails_no_put_and_leaves_no_block_pinned(tmp_path, monkeypatch):
    """ENOSPC on every write, the journal's free records too (the NVMe tier's filesystem filled):
    puts still succeed in memory, evictions from NVMe still free their slots, nothing stays pinned."""
    store = three_tier_store(tmp_path, device_blocks=1, dram_blocks=1, nvme_blocks=2)
    disk = store._tiers[2]
    k = keys(8)
    for i, key in enumerate(k[:4]):
        assert store.put(key, payload(i))
    assert len(store.blocks_in("nvme")) == 2

    def no_space(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("kvstore.disk_tier._write_all", no_space)
    monkeypatch.setattr("kvstore.disk_tier._pwrite_all", no_space)
    for i, key in enumerate(k[4:], start=4):
        assert store.put(key, payload(i))
    assert store.num_pinned == 0
    assert disk.num_free == disk.capacity_blocks - len(store.blocks_in("nvme"))
    assert disk.num_journal_errors > 0
    monkeypatch.undo()   # space again: the tier takes blocks as before
    for i, key in enumerate(keys(4, first_token=1000)):
        assert store.put(key, payload(i))
    assert len(store.blocks_in("nvme")) == 2 and store.num_pinned == 0
    held = store.blocks_in("nvme")[0]
    assert store.read(next(key for key in keys(4, first_token=1000) if key.block_hash == held))[1] == "nvme"

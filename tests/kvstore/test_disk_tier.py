import contextlib
import os
import subprocess

import numpy as np
import pytest

import kvstore.disk_tier as disk_tier
from kvstore.disk_tier import JOURNAL_NAME, DiskTier, decode_header, encode_header
from kvstore.tier_dir import LOCK_NAME
from tests.kvstore.factories import BLOCK_NBYTES, keys, payload


def _rows(first, count):
    return np.stack([np.frombuffer(payload(i), dtype=np.uint8) for i in range(first, first + count)])


def _read(tier, handles):
    out = np.empty((len(handles), BLOCK_NBYTES), dtype=np.uint8)
    tier.read_many(handles, out)
    return [bytes(row) for row in out]


@pytest.fixture
def small_disk(tmp_path):
    """A 256 KiB file system of its own (tmpfs), to be filled."""
    path = tmp_path / "disk"
    path.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(path)],
                                           capture_output=True).returncode:
        pytest.skip("needs root to mount a small tmpfs")
    yield path
    subprocess.run(["umount", "--lazy", str(path)], check=True)  # lazy: a failed test may hold a file open


def _fill(directory):
    """Writes a filler file until the disk has no room left (a file's last page keeps its slack)."""
    filler = directory / "filler"
    with open(filler, "wb", buffering=0) as file, contextlib.suppress(OSError):
        while True:
            file.write(bytes(4096))
    return filler


def _recovered(directory, capacity_blocks):
    tier = DiskTier(directory, capacity_blocks * BLOCK_NBYTES, BLOCK_NBYTES)
    found = [(key, slot) for key, slot, _ in tier.recovered()]
    tier.close()
    return found


def test_header_round_trips_and_a_flipped_bit_fails():
    key = keys(1)[0]
    header = encode_header(key, BLOCK_NBYTES, 1234)
    assert decode_header(header)[:3] == (key, BLOCK_NBYTES, 1234)
    broken = bytearray(header)
    broken[60] ^= 1  # inside the token ids
    with pytest.raises(ValueError, match="header checksum"):
        decode_header(bytes(broken))


def test_a_batch_lands_in_one_slab_and_survives_a_restart_with_frees_and_a_torn_tail(tmp_path):
    tier = DiskTier(tmp_path, 6 * BLOCK_NBYTES, BLOCK_NBYTES)
    k = keys(4)
    slots = tier.allocate(4)
    tier.write_many(slots, k, _rows(0, 4), [100, 101, 102, 103])
    assert (slots, tier.num_free) == ([0, 1, 2, 3], 2)
    assert _read(tier, [2, 0, 1]) == [payload(2), payload(0), payload(1)]
    tier.free(1)
    tier.close()
    with open(tmp_path / JOURNAL_NAME, "ab") as journal:
        journal.write(b"PDKJ\x01\x05\x00")  # a crash mid-append
    (tmp_path / ".tmp-journal.log").write_bytes(b"half")  # a crash mid-rewrite
    (tmp_path / f"{'00' * 16}.blk").write_bytes(b"PDKV")  # the old one-file-per-block layout
    reopened = DiskTier(tmp_path, 6 * BLOCK_NBYTES, BLOCK_NBYTES)
    found = list(reopened.recovered())
    assert [(key, slot, checksum) for key, slot, checksum in found] == [(k[0], 0, 100), (k[2], 2, 102),
                                                                        (k[3], 3, 103)]
    assert sorted(p.name for p in tmp_path.iterdir()) == [JOURNAL_NAME, "slab.bin", LOCK_NAME]
    assert reopened.num_free == 3 and reopened.allocate(1) == [1]
    assert _read(reopened, [3]) == [payload(3)]


def test_a_batch_whose_commit_record_never_landed_is_not_recovered(tmp_path):
    tier = DiskTier(tmp_path, 4 * BLOCK_NBYTES, BLOCK_NBYTES)
    k = keys(3)
    tier.write_many(tier.allocate(1), k[:1], _rows(0, 1), [7])
    committed = (tmp_path / JOURNAL_NAME).stat().st_size
    tier.write_many(tier.allocate(2), k[1:], _rows(1, 2), [8, 9])  # payloads written, then "power lost"
    tier.close()
    with open(tmp_path / JOURNAL_NAME, "r+b") as journal:
        journal.truncate(committed)
    reopened = DiskTier(tmp_path, 4 * BLOCK_NBYTES, BLOCK_NBYTES)
    assert [(key, slot) for key, slot, _ in reopened.recovered()] == [(k[0], 0)]
    assert reopened.num_free == 3


def test_the_journal_is_rewritten_when_it_grows_and_still_replays(tmp_path, monkeypatch):
    monkeypatch.setattr(disk_tier, "_COMPACT_MIN_BYTES", 0)
    tier = DiskTier(tmp_path, 2 * BLOCK_NBYTES, BLOCK_NBYTES)
    k = keys(50)
    for i, key in enumerate(k):
        slot = tier.allocate(1)
        tier.write_many(slot, [key], _rows(i, 1), [i])
        if i < len(k) - 1:
            tier.free(slot[0])
    size = (tmp_path / JOURNAL_NAME).stat().st_size
    assert size < 3 * len(disk_tier._record(1, 0, encode_header(k[0], BLOCK_NBYTES, 0)))
    tier.close()
    reopened = DiskTier(tmp_path, 2 * BLOCK_NBYTES, BLOCK_NBYTES)
    assert [(key, checksum) for key, _, checksum in reopened.recovered()] == [(k[-1], 49)]


def test_page_sized_slots_are_written_with_o_direct_and_read_back_after_a_restart(tmp_path):
    block_nbytes = 8192
    rows = np.random.default_rng(3).integers(0, 255, (3, block_nbytes), dtype=np.uint8)
    try:
        os.close(os.open(tmp_path / "probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT))
    except OSError:
        pytest.skip("this file system refuses O_DIRECT (tmpfs): the tier writes through the page cache there")
    (tmp_path / "probe").unlink()
    tier = DiskTier(tmp_path, 4 * block_nbytes, block_nbytes)
    assert tier.writes_direct  # a 64-byte slot never is
    tier.write_many(tier.allocate(3), keys(3), rows, [1, 2, 3])
    tier.close()
    reopened = DiskTier(tmp_path, 4 * block_nbytes, block_nbytes)
    assert [slot for _, slot, _ in reopened.recovered()] == [0, 1, 2]
    out = np.empty_like(rows)
    reopened.read_many([0, 1, 2], out)
    assert np.array_equal(out, rows)
    assert not DiskTier(tmp_path / "small", 4 * BLOCK_NBYTES, BLOCK_NBYTES).writes_direct


def test_a_tier_whose_disk_is_full_opens_with_its_blocks_and_appends_after_its_last_whole_record(small_disk):
    """The start's journal rewrite needs room for a copy; with none (ENOSPC) the worker used to fail to start."""
    tier = DiskTier(small_disk, 16 * BLOCK_NBYTES, BLOCK_NBYTES)
    k = keys(4)
    tier.write_many(tier.allocate(3), k[:3], _rows(0, 3), [0, 1, 2])
    tier.free(1)
    tier.close()
    with open(small_disk / JOURNAL_NAME, "ab") as journal:
        journal.write(b"PDKJ\x01\x05\x00")  # a crash mid-append
    filler = _fill(small_disk)
    reopened = DiskTier(small_disk, 16 * BLOCK_NBYTES, BLOCK_NBYTES)
    assert [(key, slot) for key, slot, _ in reopened.recovered()] == [(k[0], 0), (k[2], 2)]
    assert _read(reopened, [0, 2]) == [payload(0), payload(2)]
    assert reopened.num_journal_errors == 1
    assert sorted(p.name for p in small_disk.iterdir()) == ["filler", JOURNAL_NAME, "slab.bin", LOCK_NAME]
    filler.unlink()
    reopened.write_many(reopened.allocate(1), k[3:], _rows(3, 1), [3])  # appended after the torn tail was cut
    reopened.close()
    assert _recovered(small_disk, 16) == [(k[0], 0), (k[2], 2), (k[3], 1)]


def test_on_a_full_disk_a_rewrite_is_skipped_and_an_append_that_only_part_fits_is_cut_off(small_disk, monkeypatch):
    monkeypatch.setattr(disk_tier, "_COMPACT_MIN_BYTES", 0)
    tier = DiskTier(small_disk, 64 * BLOCK_NBYTES, BLOCK_NBYTES)
    k = keys(64)
    slots = tier.allocate(10)
    tier.write_many(slots, k[:10], _rows(0, 10), list(range(10)))
    filler = _fill(small_disk)
    for slot in slots[1:]:
        tier.free(slot)   # free records fit the journal's last page
    slot = tier.allocate(1)
    tier.write_many(slot, k[10:11], _rows(10, 1), [10])  # grown past twice the live: a rewrite, no room
    assert tier.num_journal_errors == 1 and not (small_disk / f".tmp-{JOURNAL_NAME}").exists()
    assert _read(tier, slot) == [payload(10)]
    journal_nbytes = (small_disk / JOURNAL_NAME).stat().st_size
    record_nbytes = len(disk_tier._record(1, 0, encode_header(k[0], BLOCK_NBYTES, 0)))
    num_more = (-journal_nbytes % 4096) // record_nbytes + 2   # more records than the last page has room for
    with pytest.raises(OSError):
        tier.write_many(tier.allocate(num_more), k[11:11 + num_more], _rows(11, num_more), [0] * num_more)
    assert (small_disk / JOURNAL_NAME).stat().st_size == journal_nbytes
    filler.unlink()
    last = k[11 + num_more]
    tier.write_many(tier.allocate(1), [last], _rows(0, 1), [0])
    tier.close()
    assert [key for key, _ in _recovered(small_disk, 64)] == [k[0], k[10], last]

import pytest

from kvstore.disk_tier import DiskTier, decode_header, encode_header
from tests.kvstore.factories import BLOCK_NBYTES, keys, payload


def test_header_round_trips_and_a_flipped_bit_fails():
    key = keys(1)[0]
    header = encode_header(key, BLOCK_NBYTES, 1234)
    assert decode_header(header)[:3] == (key, BLOCK_NBYTES, 1234)
    broken = bytearray(header)
    broken[60] ^= 1  # inside the token ids
    with pytest.raises(ValueError, match="header checksum"):
        decode_header(bytes(broken))


def test_blocks_survive_a_restart_and_debris_is_removed(tmp_path):
    tier = DiskTier(tmp_path, 4 * BLOCK_NBYTES, BLOCK_NBYTES)
    k = keys(3)
    paths = [tier.write(key, payload(i), 100 + i) for i, key in enumerate(k)]
    assert tier.num_free == 1
    assert bytes(tier.read(paths[1])) == payload(1)
    (tmp_path / ".tmp-half-written.blk").write_bytes(b"PDKV")   # a crash between write and rename
    (tmp_path / f"{'00' * 16}.blk").write_bytes(b"garbage")      # a torn or foreign file
    reopened = DiskTier(tmp_path, 4 * BLOCK_NBYTES, BLOCK_NBYTES)
    found = list(reopened.recovered())
    assert [(key, checksum) for key, _, checksum in found] == [(k[0], 100), (k[1], 101), (k[2], 102)]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in paths)
    assert reopened.num_free == 1


def test_free_deletes_the_file(tmp_path):
    tier = DiskTier(tmp_path, 2 * BLOCK_NBYTES, BLOCK_NBYTES)
    path = tier.write(keys(1)[0], payload(0), 1)
    tier.free(path)
    assert (list(tmp_path.iterdir()), tier.num_free) == ([], 2)

import hashlib
import os
import struct
import subprocess
import sys

import xxhash

from pdmesh.kv.block_hash import ROOT_PARENT, chain_block_hashes, hash_block

SEED = b"e65db6391192eab7a7cd84fb21f6cd64"
TOKENS = list(range(100))


def test_golden_values_are_pinned():
    hashes = chain_block_hashes(SEED, TOKENS, 32)
    assert [h.hex() for h in hashes] == GOLDEN


def test_chain_covers_full_blocks_and_optionally_the_partial_tail():
    assert len(chain_block_hashes(SEED, TOKENS, 32)) == 3
    with_tail = chain_block_hashes(SEED, TOKENS, 32, include_partial=True)
    assert len(with_tail) == 4
    assert with_tail[3] == hash_block(SEED, with_tail[2], TOKENS[96:])


def test_each_hash_depends_on_the_whole_prefix():
    a = chain_block_hashes(SEED, TOKENS, 32)
    b = chain_block_hashes(SEED, [1000] + TOKENS[1:], 32)
    assert all(x != y for x, y in zip(a, b))
    assert a[0] == hash_block(SEED, ROOT_PARENT, TOKENS[:32])


def test_seed_and_extra_key_separate_hash_spaces():
    base = chain_block_hashes(SEED, TOKENS, 32)
    assert chain_block_hashes(b"other-model", TOKENS, 32)[0] != base[0]
    assert chain_block_hashes(SEED, TOKENS, 32, extra_key=b"tenant-a")[0] != base[0]


def test_hashes_are_identical_in_other_processes_with_other_hash_seeds():
    code = ("from pdmesh.kv.block_hash import chain_block_hashes;"
            f"print(','.join(h.hex() for h in chain_block_hashes({SEED!r}, list(range(100)), 32)))")
    for hash_seed in ("0", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.strip().split(",") == GOLDEN


# Pinned: changing the hash formula invalidates every stored block and index entry (and needs
# pdmesh/compat.py's LAYOUT_VERSION bumped). xxh3-128 until LAYOUT_VERSION 2, SHA-256 since.
GOLDEN = ["4f091ed77226dc072457201ef7d2e4fa", "61c92852005812363e8237588b93b991",
          "c7a9cdc3c86d68192b39ec5222bc34d5"]


def test_a_name_is_the_first_128_bits_of_sha256_over_the_documented_byte_string():
    salt = b"tenant-salt"
    hashed = (struct.pack("<I", len(SEED)) + SEED + ROOT_PARENT + struct.pack("<I", len(salt)) + salt
              + struct.pack("<32i", *TOKENS[:32]))
    expected = hashlib.sha256(hashed).digest()[:16]
    assert hash_block(SEED, ROOT_PARENT, TOKENS[:32], salt) == expected
    assert chain_block_hashes(SEED, TOKENS, 32, salt)[0] == expected
    assert expected != xxhash.xxh3_128_digest(hashed)  # not the xxh3-128 names of LAYOUT_VERSION 1

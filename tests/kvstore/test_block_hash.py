import os
import subprocess
import sys

from kvstore.block_hash import ROOT_PARENT, chain_block_hashes, hash_block

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
    code = ("from kvstore.block_hash import chain_block_hashes;"
            f"print(','.join(h.hex() for h in chain_block_hashes({SEED!r}, list(range(100)), 32)))")
    for hash_seed in ("0", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.strip().split(",") == GOLDEN


# Pinned: changing the hash formula invalidates every stored block and index entry.
GOLDEN = ["035fb01e9d84b54a78ace7bc8b7c7874", "3b1693a4584e9d6ffb1c4177867755b8",
          "e80e30199a291aead7bc4f6e64a9cc1f"]


def test_formula_is_the_documented_byte_string():
    import struct

    import xxhash

    expected = xxhash.xxh3_128_digest(
        struct.pack("<I", len(SEED)) + SEED + ROOT_PARENT + struct.pack("<I", 0) + struct.pack("<32i", *TOKENS[:32]))
    assert hash_block(SEED, ROOT_PARENT, TOKENS[:32]) == expected

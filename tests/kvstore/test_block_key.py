from kvstore.block_key import block_keys
from pdmesh.kv.block_hash import ROOT_PARENT

# Pinned: a change here silently empties every store and index written before it.
GOLDEN = ["2823cda873084ef4d9a52552a00e0f5a", "caaef4c4c666a231de75c8f10f69dd55"]  # SHA-256 names


def test_keys_are_golden_and_chained_over_full_blocks_only():
    keys = block_keys(b"fp-1", list(range(10)), 4, b"tenant-a")
    assert [k.block_hash.hex() for k in keys] == GOLDEN
    assert (keys[0].parent_hash, keys[1].parent_hash) == (ROOT_PARENT, keys[0].block_hash)
    assert keys[1].token_ids == (4, 5, 6, 7)
    assert keys[1].guard_bytes().hex() == GOLDEN[0] + "04000000050000000600000007000000"


def test_a_salt_gives_another_hash_space():
    assert block_keys(b"fp-1", list(range(8)), 4, b"a")[0] != block_keys(b"fp-1", list(range(8)), 4, b"b")[0]


def test_keys_built_from_hashes_computed_once_equal_the_store_keys():
    from kvstore.block_key import block_keys, keys_of
    from pdmesh.kv.block_hash import chain_block_hashes

    tokens = list(range(3, 3 + 100))  # 3 full blocks of 32 and a partial one
    hashes = chain_block_hashes(b"seed", tokens, 32, b"salt", include_partial=True)
    assert keys_of(hashes, tokens, 32) == block_keys(b"seed", tokens, 32, b"salt")
    assert len(keys_of(hashes, tokens, 32)) == 3

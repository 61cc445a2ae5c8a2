"""A request's block names, hashed once: prefixes of it, whole or ending in a partial block, are
the names chain_block_hashes gives those tokens."""

from pdmesh.kv.block_hash import chain_block_hashes
from worker.prompt_hashes import PromptHashes

SEED, BLOCK_SIZE = b"model-fingerprint", 32
PROMPT = list(range(3, 3 + 100))   # 3 full blocks and a partial one


def _expected(num_tokens: int, salt: bytes = b"tenant") -> list[bytes]:
    return chain_block_hashes(SEED, PROMPT[:num_tokens], BLOCK_SIZE, salt, include_partial=True)


def test_every_prefix_is_named_as_its_tokens_alone_would_be_with_one_whole_hash():
    hashes = PromptHashes(SEED, BLOCK_SIZE)
    for num_tokens in (100, 99, 96, 64, 40, 31, 1):   # 99: prefill's KV without its first token
        assert hashes.of("r1", PROMPT, b"tenant", num_tokens) == _expected(num_tokens)
    assert hashes.num_hashed == 1


def test_the_salt_and_the_request_keep_names_apart_and_forget_drops_them():
    hashes = PromptHashes(SEED, BLOCK_SIZE)
    assert hashes.of("r1", PROMPT, b"tenant", 99) != hashes.of("r2", PROMPT, b"other", 99) == _expected(99, b"other")
    hashes.forget("r1")
    hashes.forget("r2")
    assert len(hashes) == 0

"""What naming a prompt's blocks costs: xxh3-128 (pdmesh's names until LAYOUT_VERSION 2) against
SHA-256 truncated to 128 bits (pdmesh/kv/block_hash.py since), per 2,048-token prompt.

python -m bench.bench_block_hash [--repeats 7 --number 200]

Both run chain_block_hashes' loop (the tokens converted once, one hash call per block over seed,
parent, salt and tokens); only the hash differs. Prints one row per block size, stamped with the
commit it ran on: median microseconds per prompt over the repeats (each the mean of --number
prompts; the two hashes' repeats alternate), and the extra cost of SHA-256.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import subprocess
import timeit
from collections.abc import Callable, Sequence

import numpy as np
import xxhash

from bench.common import random_prompts
from pdmesh.kv.block_hash import ROOT_PARENT, chain_block_hashes

PROMPT_TOKENS = 2048
BLOCK_SIZES = (32, 16)   # 64 and 128 blocks a prompt
SEED = b"0123456789abcdef0123456789abcdef"   # a model fingerprint's length
SALT = b"a-tenant-cache-salt-0123456789abcdef0123456789ab"


def xxh3_chain(seed: bytes, token_ids: Sequence[int], block_size: int, extra_key: bytes) -> list[bytes]:
    """chain_block_hashes as it was under LAYOUT_VERSION 1 (xxh3-128 names)."""
    head = len(seed).to_bytes(4, "little") + seed
    tail = len(extra_key).to_bytes(4, "little") + extra_key
    end = len(token_ids) - len(token_ids) % block_size
    tokens = np.asarray(token_ids[:end], dtype="<i4").tobytes()
    hashes, parent = [], ROOT_PARENT
    for start in range(0, end * 4, block_size * 4):
        parent = xxhash.xxh3_128_digest(b"".join((head, parent, tail, tokens[start:start + block_size * 4])))
        hashes.append(parent)
    return hashes


def us_per_prompt(chains: Sequence[Callable], prompt: list[int], block_size: int, repeats: int,
                  number: int) -> list[float]:
    """Median microseconds per prompt of each chain; their repeats alternate, so the machine's
    noise falls on all of them alike."""
    timers = [timeit.Timer(lambda chain=chain: chain(SEED, prompt, block_size, SALT)) for chain in chains]
    samples = [[timer.timeit(number) for timer in timers] for _ in range(repeats)]
    return [statistics.median(column) / number * 1e6 for column in zip(*samples)]


def commit() -> str:
    """The commit the row ran on, "+dirty" when tracked files differ from it."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, check=False).stdout.strip()

    dirty = git("status", "--porcelain", "--untracked-files=no")
    return git("rev-parse", "--short", "HEAD") + ("+dirty" if dirty else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--number", type=int, default=200)
    args = parser.parse_args()
    prompt = random_prompts(1, PROMPT_TOKENS, seed=0, vocab_size=128_000)[0]
    stamp = commit()
    print(f"block names of one {PROMPT_TOKENS}-token prompt, median of {args.repeats} x {args.number} "
          f"({platform.machine()}, python {platform.python_version()})")
    print(f"{'blocks':>6} {'tokens/block':>12} {'xxh3-128 us':>12} {'sha256/128 us':>14} {'extra us':>9} {'ratio':>6}"
          f"  commit")
    for block_size in BLOCK_SIZES:
        old, new = us_per_prompt((xxh3_chain, chain_block_hashes), prompt, block_size, args.repeats, args.number)
        print(f"{PROMPT_TOKENS // block_size:>6} {block_size:>12} {old:>12.1f} {new:>14.1f} {new - old:>9.1f} "
              f"{new / old:>6.2f}  {stamp}")


if __name__ == "__main__":
    main()

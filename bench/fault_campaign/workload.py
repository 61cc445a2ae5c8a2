"""The campaign's prompts (shared prefixes, so KV stores are read across nodes, and single prompts
from 1 token to many blocks) and monolithic vLLM's greedy tokens for each."""

from __future__ import annotations

import random
from pathlib import Path

from bench.fault_campaign.load import Workload
from worker.baseline import run_in_subprocess

VOCAB = 1024
PREFIX_TOKENS = 192        # 6 blocks of 32
SINGLE_LENGTHS = (1, 17, 33, 64, 100, 150, 250, 300, 400, 500)


def campaign_prompts(seed: int = 16, num_prefixes: int = 8, per_prefix: int = 3) -> list[list[int]]:
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, VOCAB) for _ in range(n)]

    prefixes = [[0] + tokens(PREFIX_TOKENS - 1) for _ in range(num_prefixes)]
    family = [prefix + tokens(rng.randrange(8, 64)) for _ in range(per_prefix) for prefix in prefixes]
    singles = [[0] + tokens(n - 1) for n in SINGLE_LENGTHS]
    return family + singles


def build_workload(model_dir: Path, work_dir: Path, max_tokens: int = 32, num_prefixes: int = 8) -> Workload:
    prompts = campaign_prompts(num_prefixes=num_prefixes)
    sampling = {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    runs = run_in_subprocess(model_dir, [{"prompts": prompts, "sampling": sampling}], work_dir)["runs"]
    return Workload(prompts, runs[0]["token_ids"], max_tokens)

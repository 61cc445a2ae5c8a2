"""Request traces in Mooncake's format (what AIPerf's `mooncake_trace` dataset reads): one JSON
object per line, {"timestamp": ms since the trace began, "input_length": tokens,
"output_length": tokens, "hash_ids": [ids of the prompt's 512-token blocks]}. Two requests whose
hash_ids start alike share that prefix: the replayer builds each block's tokens from its id and a
salt (the workload's seed at the point), so two workloads or two speeds of one trace share nothing.

python -m bench.serving.trace   writes the committed synthetic traces (bench/serving/traces/).
"""

from __future__ import annotations

import functools
import json
import math
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

TRACES_DIR = Path(__file__).resolve().parent / "traces"
HASH_BLOCK_TOKENS = 512   # Mooncake's trace block
VOCAB = (3, 1024)         # token ids drawn from here (the tiny models' vocabulary, past the special ids)


@dataclass(frozen=True)
class TraceRequest:
    timestamp: int           # ms since the trace began
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    def prompt(self, salt: int) -> list[int]:
        """The prompt's tokens: each block's from its id and the salt, so shared ids give shared prefixes."""
        tokens = [t for block in self.hash_ids for t in block_tokens(block, salt)]
        return tokens[:self.input_length]


def block_tokens(hash_id: int, salt: int) -> list[int]:
    rng = random.Random(f"{salt}:{hash_id}")
    return [rng.randrange(*VOCAB) for _ in range(HASH_BLOCK_TOKENS)]


@functools.cache
def load(path: Path, limit: int = 0) -> tuple[TraceRequest, ...]:
    """The trace's requests in time order (its first `limit` if > 0); read once a process."""
    requests = []
    for line in path.read_text().splitlines():
        if line.strip():
            fields = json.loads(line)
            requests.append(TraceRequest(int(fields["timestamp"]), int(fields["input_length"]),
                                         int(fields["output_length"]), tuple(fields["hash_ids"])))
    requests.sort(key=lambda r: r.timestamp)
    return tuple(requests[:limit] if limit > 0 else requests)


def offered_rate(requests: Sequence[TraceRequest], speed: float) -> float:
    """Requests per second of the trace replayed at `speed`."""
    span_s = (requests[-1].timestamp - requests[0].timestamp) / 1e3 if len(requests) > 1 else 0.0
    return len(requests) / span_s * speed if span_s > 0 else 0.0


def write(path: Path, requests: Sequence[TraceRequest]) -> None:
    path.write_text("".join(json.dumps({**asdict(r), "hash_ids": list(r.hash_ids)}) + "\n" for r in requests))


# ---- the committed synthetic traces ----
def phase_change(seed: int = 7, phase_s: float = 60.0, num_phases: int = 4) -> list[TraceRequest]:
    """Alternating phases: long prompts (2,000 in / 64 out, 1.5 req/s), then chat (256 in / 256 out, 3 req/s)."""
    rng, ids, requests, start_ms = random.Random(seed), _Ids(), [], 0.0
    for phase in range(num_phases):
        long_phase = phase % 2 == 0
        rate, input_len, output_len = (1.5, 2000, 64) if long_phase else (3.0, 256, 256)
        at_s = 0.0
        while (at_s := at_s + rng.expovariate(rate)) < phase_s:
            requests.append(TraceRequest(round(start_ms + 1e3 * at_s), input_len, output_len, ids.fresh(input_len)))
        start_ms += 1e3 * phase_s
    return requests


def conversation(seed: int = 11, duration_s: float = 150.0, rate: float = 2.0) -> list[TraceRequest]:
    """Chat-like traffic: a few system prompts shared by many conversations, turns that extend their
    conversation's prompt, log-normal lengths (median ~700 in, ~120 out)."""
    rng, ids, requests = random.Random(seed), _Ids(), []
    system_prompts = [ids.fresh(HASH_BLOCK_TOKENS * rng.randint(1, 2)) for _ in range(4)]
    open_conversations: list[tuple[int, ...]] = []
    at_s = 0.0
    while (at_s := at_s + rng.expovariate(rate)) < duration_s:
        if open_conversations and rng.random() < 0.4:   # a next turn: the history, then the new message
            history = open_conversations.pop(rng.randrange(len(open_conversations)))
        else:
            history = rng.choice(system_prompts)
        new_len = min(2500, max(32, int(rng.lognormvariate(math.log(400), 0.8))))
        input_len = min(3000, len(history) * HASH_BLOCK_TOKENS + new_len)
        hash_ids = history + ids.fresh(input_len - len(history) * HASH_BLOCK_TOKENS)
        output_len = min(400, max(8, int(rng.lognormvariate(math.log(120), 0.6))))
        requests.append(TraceRequest(round(1e3 * at_s), input_len, output_len, hash_ids))
        if input_len + output_len < 2500:
            open_conversations.append(hash_ids)
    return requests


class _Ids:
    def __init__(self) -> None:
        self._next = 0

    def fresh(self, num_tokens: int) -> tuple[int, ...]:
        """New block ids covering num_tokens."""
        count = -(-num_tokens // HASH_BLOCK_TOKENS)
        self._next += count
        return tuple(range(self._next - count, self._next))


if __name__ == "__main__":
    TRACES_DIR.mkdir(exist_ok=True)
    for name, requests in (("phase_change", phase_change()), ("conversation", conversation())):
        write(TRACES_DIR / f"{name}.jsonl", requests)
        print(f"{name}: {len(requests)} requests, {offered_rate(requests, 1.0):.2f} req/s")

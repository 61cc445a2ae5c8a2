"""The serving benchmark's workloads and profiles.

A workload is run at several points: a concurrency (closed loop: each stream sends its next request
when the last one ends), a Poisson request rate, or a trace's speed (1.0: replayed on its recorded
timestamps; 2.0: twice as fast). Every point sends `num_prompts` requests (200 or more in the
measured profiles: a few seconds of a burst is not a steady state), with prompts drawn from a seed
derived from the workload's name and the point: the same prompts for every arm and repeat, and other
prompts at every point (a point must not hit the prefix cache the points before it filled).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

CLOSED, POISSON, TRACE = "closed", "poisson", "trace"
TINY, MID = "tiny", "mid"   # the models (pdmesh/models/tiny.py): overhead-bound, compute-bound


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    kind: str                         # CLOSED, POISSON or TRACE
    points: tuple[float, ...]         # concurrencies, request rates (req/s) or trace speeds
    num_prompts: int                  # per point
    dataset_args: tuple[str, ...] = ()   # vLLM's load tool's dataset flags (CLOSED, POISSON)
    trace: str = ""                   # TRACE: a file in bench/serving/traces/ (Mooncake's trace format)
    model: str = TINY

    def seed(self, point: float) -> int:
        """From the workload's name and the point, never from its position in a profile."""
        return int.from_bytes(hashlib.sha256(f"{self.name}@{point:g}".encode()).digest()[:4], "little")


@dataclass(frozen=True)
class Slo:
    name: str
    ttft_ms: float
    tpot_ms: float


SLOS = (Slo("relaxed", 2500.0, 60.0), Slo("tight", 1000.0, 25.0))
ATTAINMENT_GOAL = 0.9   # DistServe's: goodput is the highest rate at which 90% of requests meet both SLOs


def random_lengths(input_len: int, output_len: int, range_ratio: float = 0.0) -> tuple[str, ...]:
    return ("--dataset-name", "random", "--random-input-len", str(input_len), "--random-output-len", str(output_len),
            "--random-range-ratio", str(range_ratio))


SHARED_PREFIX = ("--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", "1536",
                 "--prefix-repetition-suffix-len", "256", "--prefix-repetition-num-prefixes", "4",
                 "--prefix-repetition-output-len", "64")

SHORT = Workload("short", "random 512 in / 128 out, closed loop", CLOSED, (4, 16, 32), 200,
                 random_lengths(512, 128))
LONG = Workload("long", "random 2,000 in / 64 out, Poisson", POISSON, (1.0, 2.0, 3.0, 4.0, 5.0), 200,
                random_lengths(2000, 64))
MIXED = Workload("mixed", "random 100-1,900 in / 13-243 out, Poisson", POISSON, (2.0, 4.0, 6.0, 8.0), 200,
                 random_lengths(1000, 128, 0.9))
SHARED = Workload("shared_prefix", "4 shared 1,536-token prefixes + 256 own tokens / 64 out, Poisson", POISSON,
                  (2.0, 4.0, 6.0, 8.0), 200, SHARED_PREFIX)
PHASES = Workload("phase_change", "alternating minutes of long prompts (2,000 / 64) and chat (256 / 256), "
                  "replayed on its timestamps", TRACE, (0.5, 1.0, 1.5), 0, trace="phase_change.jsonl")
TRACE_MIXED = Workload("trace", "a synthetic trace in Mooncake's format: lengths and shared prefixes of "
                       "conversation traffic, replayed on its timestamps", TRACE, (0.5, 1.0, 1.5), 0,
                       trace="conversation.jsonl")

PROFILES: dict[str, tuple[Workload, ...]] = {
    "full": (SHORT, LONG, MIXED, SHARED, PHASES, TRACE_MIXED),
    # the compute-bound model: where a long prefill's compute, not overhead, stalls a colocated batch
    "mid": (Workload("long_mid", "random 2,000 in / 64 out, Poisson, the compute-bound model", POISSON,
                     (0.25, 0.5, 0.75), 200, random_lengths(2000, 64), model=MID),
            Workload("phase_change_mid", "phase change on the compute-bound model", TRACE, (0.25, 0.5), 0,
                     trace="phase_change.jsonl", model=MID)),
    # a few requests per point: CI runs it so the path stays tested; its figures are not a steady state
    "smoke": (Workload("short", "random 128 in / 16 out, closed loop", CLOSED, (4,), 8, random_lengths(128, 16)),
              Workload("trace", "the conversation trace's first requests, fast", TRACE, (8.0,), 8,
                       trace="conversation.jsonl")),
}

# Run on every arm before it is measured (first-touch costs), with prompts no point uses.
WARMUP = Workload("warmup", "random 64 in / 8 out", CLOSED, (4,), 8, random_lengths(64, 8))

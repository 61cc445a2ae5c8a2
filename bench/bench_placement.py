"""What adaptive placement costs the gateway per request (issue 32's target: <= 50 us).

python -m bench.bench_placement [--repeats 7 --number 2000]

Workers taking both roles, each with published rates, 4 streams and a prefix cache the gateway has
seen fill with 64 other prompts; one request of a 2,000-token prompt placed over them: every option
weighed and chosen, and its prefix recorded (gateway/placement.py), at 2, 4 and 8 workers. Naming
the prompt's blocks (one hash chain, shared with routing) is timed apart. Prints median
microseconds per request over the repeats (each the mean of --number requests) and writes
bench/report/placement.json, stamped with commit, machine and time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import timeit
from dataclasses import asdict

from bench.common import REPORT_DIR, random_prompts
from bench.stamp import run_stamp
from gateway.disagg import DisaggCosts
from gateway.flows import Flows
from gateway.placement import Placement
from gateway.pool import BOTH, Worker
from gateway.prompt_names import PromptNames
from gateway.seen_prefixes import SeenPrefixes
from gateway.slo import RequestSlo
from pdmesh.v1 import common_pb2, worker_pb2

PROMPT_TOKENS = 2000
WORKER_COUNTS = (2, 4, 8)
STREAMS_PER_WORKER = 4
SEEN_PROMPTS = 64
COMPAT = common_pb2.CompatInfo(model_fingerprint="fp", dtype="float32", block_size=32, layout="l", num_layers=4,
                               block_nbytes=1024)


def workers(count: int) -> list[Worker]:
    info = worker_pb2.WorkerInfoResponse(role=BOTH, model="m", max_model_len=4096, compat=COMPAT, vocab_size=1024)
    return [Worker(f"10.0.0.{i}:50051", BOTH, channel=None, info=info, in_flight=STREAMS_PER_WORKER,
                   prefill_tokens_per_s=10_000.0 + i) for i in range(count)]


def placement_with_history(mesh: list[Worker]) -> Placement:
    """Streams running on every worker, and a prefix history the size of a busy gateway's."""
    flows = Flows()
    for worker in mesh:
        for _ in range(STREAMS_PER_WORKER):
            stream = flows.open(worker.address, 100, 0.06, movable=True)
            stream.on_tokens(1, now=0.0)
            stream.on_tokens(1, now=0.02)
    placement = Placement(DisaggCosts(initial_handoff_s=0.02), SeenPrefixes(), flows, RequestSlo(2.5, 0.06))
    for i, prompt in enumerate(random_prompts(SEEN_PROMPTS, PROMPT_TOKENS, seed=1)):
        names = PromptNames(prompt)
        placement.record(names, placement.choose(placement.options(names, mesh[i % len(mesh):][:1], mesh)))
    return placement


def us_per_request(count: int, prompt: list[int], repeats: int, number: int) -> dict[str, float]:
    mesh = workers(count)
    placement = placement_with_history(mesh)
    names = PromptNames(prompt)
    names.of(COMPAT)   # hashed once per request, for routing too: timed apart below

    def place_once() -> None:
        placement.record(names, placement.choose(placement.options(names, mesh, mesh)))

    place = [timeit.timeit(place_once, number=number) / number * 1e6 for _ in range(repeats)]
    name = [timeit.timeit(lambda: PromptNames(prompt).of(COMPAT), number=number // 10) / (number // 10) * 1e6
            for _ in range(repeats)]
    return {"workers": count, "options": len(placement.options(names, mesh, mesh)),
            "placement_us_median": statistics.median(place), "placement_us_min": min(place),
            "placement_us_max": max(place), "naming_us_median": statistics.median(name)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--number", type=int, default=2000)
    args = parser.parse_args()
    prompt = random_prompts(1, PROMPT_TOKENS, seed=0)[0]
    stamp = run_stamp()
    rows = [us_per_request(count, prompt, args.repeats, args.number) for count in WORKER_COUNTS]
    print(f"placement of one {PROMPT_TOKENS}-token request, us, median [min-max] of {args.repeats} x "
          f"{args.number} ({stamp.code}, {stamp.machine}, {stamp.run_at} UTC)")
    for row in rows:
        print(f"{row['workers']} workers, {row['options']:>2} options: {row['placement_us_median']:.1f} "
              f"[{row['placement_us_min']:.1f}-{row['placement_us_max']:.1f}]; naming the prompt's blocks "
              f"{row['naming_us_median']:.1f}")
    (REPORT_DIR / "placement.json").write_text(json.dumps({**asdict(stamp), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

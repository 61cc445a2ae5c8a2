"""The gateway's memory under a long load, alone (stub workers behind it): PSS after each round.

python -m bench.bench_gateway_memory [--rounds 8 --requests-per-round 4992 --streams 64]

The soak's prompts (bench/soak.py: 32 shared 192-token prefixes with 3 suffixes each, and singles
up to 500 tokens), 32 tokens each, one request in 64 with a cache salt of its own (the soak's probe
tenant). Prints the gateway's PSS before the first request and after each round: a leak grows
round after round, a warm-up only over the first.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import tempfile
import uuid
from pathlib import Path

import grpc

from bench.fault_campaign.resources import pss_bytes
from bench.fault_campaign.workload import campaign_prompts
from bench.serving.arms import spawned
from bench.soak import NUM_PREFIXES
from pdmesh.client import make_request
from pdmesh.config import DEFAULT_MODEL_DIR
from pdmesh.transport.grpc_options import GRPC_OPTIONS
from pdmesh.v1 import generate_pb2_grpc

SALTED_EVERY = 64


def pss_mib(pid: int) -> float:
    return pss_bytes(Path(f"/proc/{pid}")) / 2**20


async def _rounds(address: str, pid: int, args) -> None:
    prompts = campaign_prompts(num_prefixes=NUM_PREFIXES)
    next_index = itertools.count()
    async with grpc.aio.insecure_channel(address, options=GRPC_OPTIONS) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)

        async def request(index: int) -> None:
            message = make_request(prompts[index % len(prompts)], max_tokens=32, request_id=uuid.uuid4().hex,
                                   ignore_eos=True)
            if index % SALTED_EVERY == 0:
                message.cache_salt = uuid.uuid4().hex
            async for _ in stub.Generate(message):
                pass

        async def stream(num_requests: int) -> None:
            for _ in range(num_requests):
                await request(next(next_index))

        for round_index in range(args.rounds):
            await asyncio.gather(*(stream(args.requests_per_round // args.streams) for _ in range(args.streams)))
            done = (round_index + 1) * (args.requests_per_round // args.streams) * args.streams
            print(f"round {round_index + 1}: {done} requests, gateway PSS {pss_mib(pid):.1f} MiB", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--requests-per-round", type=int, default=4992)
    parser.add_argument("--streams", type=int, default=64)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="pdmesh-gateway-memory-"))
    with spawned(["-m", "bench.stub_workers", str(work / "stubs.json"), "--num-tokens", "32"], work / "stubs.json",
                 work / "stubs.log") as stubs, \
            spawned(["-m", "gateway", "--port", "0", "--tokenizer", str(DEFAULT_MODEL_DIR), "--route_policy",
                     "round_robin", "--prefill_workers", json.dumps([stubs["prefill"]]),
                     "--decode_workers", json.dumps([stubs["decode"]]), "--ready_file", str(work / "gateway.json"),
                     "--exit_with_parent"], work / "gateway.json", work / "gateway.log") as gateway:
        print(f"before the first request: gateway PSS {pss_mib(gateway['pid']):.1f} MiB", flush=True)
        asyncio.run(_rounds(gateway["address"], gateway["pid"], args))


if __name__ == "__main__":
    main()

"""Gateway overhead: the same streams direct to a decode worker and through the gateway.

python -m bench.bench_gateway_overhead [--concurrency 200 --requests 2000 --tokens 16 --paced-interval-ms 50]

Stub workers (bench/stub_workers.py: no engine) and a real gateway process (`python -m gateway`) in
front of them; a client keeps `--concurrency` gRPC streams open at once. Two scenarios:
- burst: decode streams its tokens at once, so the processes run flat out: throughput, and the
  gateway's CPU time per request (its process's user + system time over the requests it served);
- paced: decode streams a token every `--paced-interval-ms` (an engine step), as a real decode
  does: the latency the gateway adds to a request when it is not the bottleneck.
Per request: time to first token and to the last. The overhead is the difference of the medians
between the two paths (the gateway adds a Prefill call and a hop per chunk). Target of the serving
issue: <= 2 ms p50 at 200 concurrent streams. Writes bench/report/gateway_overhead.json and .png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc

from bench.common import REPORT_DIR, plot_bars
from bench.serving.arms import spawned
from pdmesh.client import make_request
from pdmesh.config import DEFAULT_MODEL_DIR
from pdmesh.transport.grpc_options import GRPC_OPTIONS
from pdmesh.v1 import common_pb2, generate_pb2_grpc, worker_pb2, worker_pb2_grpc

PROMPT = list(range(3, 3 + 64))
WARMUP_REQUESTS = 50


async def _timed(stream) -> tuple[float, float]:
    started = time.perf_counter()
    first = None
    async for chunk in stream:
        if first is None and chunk.token_ids:
            first = time.perf_counter() - started
    return first or 0.0, time.perf_counter() - started


async def _drive(open_stream: Callable[[int], Awaitable], num_requests: int, concurrency: int) -> dict:
    limit = asyncio.Semaphore(concurrency)
    samples: list[tuple[float, float]] = []

    async def one(i: int) -> None:
        async with limit:
            samples.append(await _timed(open_stream(i)))

    started = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(num_requests)))
    seconds = time.perf_counter() - started
    ttft, e2e = sorted(s[0] for s in samples), sorted(s[1] for s in samples)
    return {"requests_per_s": num_requests / seconds,
            "ttft_ms": {"50": 1e3 * statistics.median(ttft), "99": 1e3 * ttft[int(0.99 * len(ttft))]},
            "e2e_ms": {"50": 1e3 * statistics.median(e2e), "99": 1e3 * e2e[int(0.99 * len(e2e))]}}


async def _direct(decode_address: str, args) -> dict:
    async with grpc.aio.insecure_channel(decode_address, options=GRPC_OPTIONS) as channel:
        stub = worker_pb2_grpc.DecodeStub(channel)
        sampling = common_pb2.SamplingParams(max_tokens=args.tokens)
        await _drive(lambda i: stub.Decode(worker_pb2.DecodeRequest(request_id=f"w{i}", prompt_token_ids=PROMPT,
                                                                    sampling=sampling)), 50, 10)  # warm-up
        return await _drive(lambda i: stub.Decode(worker_pb2.DecodeRequest(
            request_id=f"d{i}", prompt_token_ids=PROMPT, sampling=sampling)), args.requests, args.concurrency)


async def _through_gateway(gateway_address: str, args) -> dict:
    async with grpc.aio.insecure_channel(gateway_address, options=GRPC_OPTIONS) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        await _drive(lambda i: stub.Generate(make_request(PROMPT, max_tokens=args.tokens)), WARMUP_REQUESTS,
                     10)  # warm-up
        return await _drive(lambda i: stub.Generate(make_request(PROMPT, max_tokens=args.tokens)), args.requests,
                            args.concurrency)


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _scenario(args, token_interval_ms: float, work: Path) -> dict:
    stubs_ready, gateway_ready = work / f"stubs-{token_interval_ms:g}.json", work / f"gateway-{token_interval_ms:g}.json"
    with spawned(["-m", "bench.stub_workers", str(stubs_ready), "--num-tokens", str(args.tokens),
                  "--token-interval-ms", str(token_interval_ms)], stubs_ready, work / "stubs.log") as stubs, \
            spawned(["-m", "gateway", "--port", "0", "--tokenizer", str(DEFAULT_MODEL_DIR),
                     "--prefill_workers", json.dumps([stubs["prefill"]]),
                     "--decode_workers", json.dumps([stubs["decode"]]),
                     "--max_in_flight", str(args.concurrency * 2), "--ready_file", str(gateway_ready),
                     "--exit_with_parent", *shlex.split(args.gateway_args)], gateway_ready,
                    work / "gateway.log") as gateway:
        direct = asyncio.run(_direct(stubs["decode"], args))
        cpu_before = _cpu_seconds(gateway["pid"])
        through = asyncio.run(_through_gateway(gateway["address"], args))
        cpu_ms_per_request = 1e3 * (_cpu_seconds(gateway["pid"]) - cpu_before) / (args.requests + WARMUP_REQUESTS)
    overhead = {k: through[k]["50"] - direct[k]["50"] for k in ("ttft_ms", "e2e_ms")}
    return {"token_interval_ms": token_interval_ms, "direct_to_decode": direct, "through_gateway": through,
            "gateway_overhead_ms_p50": overhead, "gateway_cpu_ms_per_request": cpu_ms_per_request}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, default=200)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--paced-interval-ms", type=float, default=50.0)
    parser.add_argument("--gateway-args", default="", help="more gateway flags, e.g. '--disagg_policy local' "
                        "(the prompt computed on the decode worker: one call a request, not two)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        scenarios = {"burst": _scenario(args, 0.0, Path(work)),
                     "paced": _scenario(args, args.paced_interval_ms, Path(work))}
    results = {"workload": vars(args), **scenarios}
    REPORT_DIR.mkdir(parents=True, exist_ok=True)
    (REPORT_DIR / "gateway_overhead.json").write_text(json.dumps(results, indent=1))
    burst, paced = scenarios["burst"], scenarios["paced"]
    plot_bars("gateway_overhead", [
        ("burst: requests/s", {"direct": burst["direct_to_decode"]["requests_per_s"],
                               "gateway": burst["through_gateway"]["requests_per_s"]}),
        ("paced: TTFT p50 (ms)", {"direct": paced["direct_to_decode"]["ttft_ms"]["50"],
                                  "gateway": paced["through_gateway"]["ttft_ms"]["50"]}),
        ("paced: end to end p50 (ms)", {"direct": paced["direct_to_decode"]["e2e_ms"]["50"],
                                        "gateway": paced["through_gateway"]["e2e_ms"]["50"]}),
        ("gateway CPU ms / request", {"burst": burst["gateway_cpu_ms_per_request"],
                                      "paced": paced["gateway_cpu_ms_per_request"]})],
        out_dir=REPORT_DIR)
    for name, result in scenarios.items():
        direct, through, overhead = result["direct_to_decode"], result["through_gateway"], result["gateway_overhead_ms_p50"]
        print(f"{name}: {args.concurrency} concurrent streams, {args.tokens} tokens each: direct TTFT p50 "
              f"{direct['ttft_ms']['50']:.2f} ms, e2e {direct['e2e_ms']['50']:.2f} ms, {direct['requests_per_s']:.0f} "
              f"req/s | through the gateway TTFT {through['ttft_ms']['50']:.2f} ms, e2e {through['e2e_ms']['50']:.2f} "
              f"ms, {through['requests_per_s']:.0f} req/s | overhead p50: TTFT {overhead['ttft_ms']:.2f} ms, e2e "
              f"{overhead['e2e_ms']:.2f} ms (target <= 2 ms) | gateway CPU {result['gateway_cpu_ms_per_request']:.2f} "
              f"ms per request")


if __name__ == "__main__":
    main()

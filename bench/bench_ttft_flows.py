"""Time to first token of the two P/D flows, side by side on one cluster, one request at a time.

python -m bench.bench_ttft_flows [--requests 10 --prompt-len 256 --output-len 8]
first_token_from=decode (vLLM's flow): prefill, KV pull, decode's first step, then the token.
first_token_from=prefill (SGLang's flow): the token streams as soon as prefill returns.
Requests alternate between the two gateways (the cluster's, and one in this process) with fresh
prompts, so both see the same machine state. Prints medians and the ratio; writes JSON + PNG.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from bench.common import plot_bars, random_prompts, write_results
from gateway.server import Gateway
from pdmesh.client import make_request, stream_generate
from pdmesh.cluster import LocalCluster
from pdmesh.config import DEFAULT_MODEL_DIR, GatewaySettings
from pdmesh.models.tiny import ensure_llama


async def _ttft(address: str, prompt: list[int], output_len: int) -> tuple[float, float]:
    started = time.perf_counter()
    first = 0.0
    async for response in stream_generate(address, make_request(prompt, max_tokens=output_len, ignore_eos=True)):
        if response.token_ids and not first:
            first = time.perf_counter() - started
    return first, time.perf_counter() - started


async def _compare(cluster: LocalCluster, model_dir: Path, args) -> dict[str, list[tuple[float, float]]]:
    gateway = Gateway(GatewaySettings(port=0, prefill_workers=cluster.prefill_addresses,
                                      decode_workers=cluster.decode_addresses, tokenizer=str(model_dir),
                                      first_token_from="prefill", mesh_token=cluster.mesh_token))
    addresses = {"decode": cluster.gateway_address, "prefill": await gateway.start()}
    samples: dict[str, list[tuple[float, float]]] = {"decode": [], "prefill": []}
    try:
        prompts = random_prompts(2 * args.requests + 2, args.prompt_len, seed=77)
        for mode in ("decode", "prefill"):  # warm-up
            await _ttft(addresses[mode], prompts.pop(), args.output_len)
        for i, prompt in enumerate(prompts):
            mode = ("decode", "prefill")[i % 2]
            samples[mode].append(await _ttft(addresses[mode], prompt, args.output_len))
    finally:
        await gateway.stop(0)
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(DEFAULT_MODEL_DIR))
    parser.add_argument("--requests", type=int, default=10)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=8)
    args = parser.parse_args()
    model_dir = ensure_llama(Path(args.model))
    with tempfile.TemporaryDirectory() as run_dir, LocalCluster(model_dir, Path(run_dir)) as cluster:
        samples = asyncio.run(_compare(cluster, model_dir, args))
    ttft = {mode: statistics.median(t for t, _ in s) * 1e3 for mode, s in samples.items()}
    total = {mode: statistics.median(e for _, e in s) * 1e3 for mode, s in samples.items()}
    results = {"workload": vars(args), "ttft_ms_median": ttft, "e2e_ms_median": total,
               "ttft_prefill_over_decode": ttft["prefill"] / ttft["decode"], "raw": samples}
    json_path = write_results("ttft_flows", results)
    png_path = plot_bars("ttft_flows", [("TTFT ms (median)", {f"first token from {m}": v for m, v in ttft.items()}),
                                        ("end-to-end ms (median)", {f"from {m}": v for m, v in total.items()})])
    print(f"TTFT median: from decode {ttft['decode']:.1f} ms | from prefill {ttft['prefill']:.1f} ms | "
          f"ratio {ttft['prefill'] / ttft['decode']:.2f}; end-to-end {total['decode']:.1f} vs {total['prefill']:.1f} ms")
    print(f"wrote {json_path} and {png_path}")


if __name__ == "__main__":
    main()

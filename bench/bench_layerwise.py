"""Time to first token of the layer-wise KV flow against the pull flow, side by side on one cluster.

python -m bench.bench_layerwise [--requests 30 --lengths 512 2048 4000 --output-len 4 --models tiny wide]

pull: prefill computes the prompt, then decode reads its KV (vLLM's P/D flow). layerwise: decode is
picked and reserves its blocks first, and reads each layer while prefill computes the next
(--kv_flow layerwise). Per model (the test models' tiny Llama; a wider one with twice the layers
and four times the KV per token, built locally, where each layer's compute is larger) one cluster
(1 prefill, 1 decode, shared memory); requests run in back-to-back pairs, one through the
cluster's gateway (pull) and one through a gateway in this process (layerwise), the pair's order
alternating, with fresh prompts. Reports per prompt length: median TTFT of each flow, pull's
measured transfer time, the layer-wise overlap ratio, and whether layer-wise TTFT <= pull TTFT -
0.8 x pull's transfer time (>= 80% of the transfer hidden), by the two medians and by the median
of the pairs' differences; and TTFT split at prefill's answer (the gateway's Prefill call, then
the handoff to decode's first token). Writes bench/report/layerwise.{json,png}.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from bench.common import REPORT_DIR, random_prompts, write_results
from gateway.server import Gateway
from pdmesh.client import make_request, stream_generate
from pdmesh.cluster import LocalCluster
from pdmesh.config import GatewaySettings
from pdmesh.models.tiny import ensure_llama, ensure_llama_wide

MODELS = {"tiny": ensure_llama, "wide": ensure_llama_wide}
FLOWS = ("pull", "layerwise")


async def _one(address: str, prompt: list[int], output_len: int) -> dict:
    started, ttft, last = time.perf_counter(), 0.0, None
    async for response in stream_generate(address, make_request(prompt, max_tokens=output_len, ignore_eos=True)):
        if response.token_ids and not ttft:
            ttft = time.perf_counter() - started
        last = response
    transfer = last.transfer
    return {"ttft_s": ttft, "transfer_s": transfer.seconds, "num_blocks": transfer.num_blocks,
            "layerwise": transfer.layerwise, "before_s": transfer.seconds_before_prefill_done,
            "after_s": transfer.seconds_after_prefill_done, "overlap_ratio": transfer.overlap_ratio,
            "prefill_s": transfer.prefill_seconds, "handoff_s": transfer.handoff_seconds}


async def _compare(cluster: LocalCluster, model_dir: Path, args) -> dict:
    gateway = Gateway(GatewaySettings(port=0, prefill_workers=cluster.prefill_addresses,
                                      decode_workers=cluster.decode_addresses, tokenizer=str(model_dir),
                                      kv_flow="layerwise", mesh_token=cluster.mesh_token))
    addresses = {"pull": cluster.gateway_address, "layerwise": await gateway.start()}
    samples: dict[int, dict[str, list[dict]]] = {}
    try:
        for length in args.lengths:
            prompts = random_prompts(2 * args.requests + 2, length, seed=length)
            for flow in FLOWS:  # warm-up
                await _one(addresses[flow], prompts.pop(), args.output_len)
            samples[length] = {flow: [] for flow in FLOWS}
            for pair in range(args.requests):  # pull first in even pairs, layer-wise first in odd ones
                for flow in (FLOWS if pair % 2 == 0 else FLOWS[::-1]):
                    samples[length][flow].append(await _one(addresses[flow], prompts.pop(), args.output_len))
    finally:
        await gateway.stop(0)
    return samples


def _median_ms(samples: list[dict], key: str) -> float:
    return statistics.median(s[key] for s in samples) * 1e3


def _summary(samples: dict[int, dict[str, list[dict]]]) -> dict:
    rows = {}
    for length, by_flow in samples.items():
        pull_ttft = statistics.median(s["ttft_s"] for s in by_flow["pull"])
        pull_transfer = statistics.median(s["transfer_s"] for s in by_flow["pull"])
        layerwise_ttft = statistics.median(s["ttft_s"] for s in by_flow["layerwise"])
        # each (pull, layer-wise) pair ran back to back on the same machine state
        paired = [p["ttft_s"] - w["ttft_s"] for p, w in zip(by_flow["pull"], by_flow["layerwise"])]
        paired_saved = statistics.median(paired)
        rows[length] = {
            "pull_ttft_ms": pull_ttft * 1e3, "layerwise_ttft_ms": layerwise_ttft * 1e3,
            "pull_transfer_ms": pull_transfer * 1e3,
            "layerwise_transfer_ms": statistics.median(s["transfer_s"] for s in by_flow["layerwise"]) * 1e3,
            "layerwise_after_prefill_ms": statistics.median(s["after_s"] for s in by_flow["layerwise"]) * 1e3,
            "overlap_ratio": statistics.median(s["overlap_ratio"] for s in by_flow["layerwise"]),
            "ttft_saved_ms": (pull_ttft - layerwise_ttft) * 1e3,
            "paired_saved_ms": paired_saved * 1e3,
            "pairs_layerwise_faster": sum(d > 0 for d in paired), "num_pairs": len(paired),
            "share_of_pull_transfer_saved": (pull_ttft - layerwise_ttft) / pull_transfer if pull_transfer else 0.0,
            "target_met": layerwise_ttft <= pull_ttft - 0.8 * pull_transfer,
            "target_met_paired": paired_saved >= 0.8 * pull_transfer,
            # TTFT split at prefill's answer (the gateway's clock): prefill's call, then the handoff to
            # decode's first token (layer-wise: < 0 where decode had its token before prefill answered)
            "pull_prefill_ms": _median_ms(by_flow["pull"], "prefill_s"),
            "layerwise_prefill_ms": _median_ms(by_flow["layerwise"], "prefill_s"),
            "pull_handoff_ms": _median_ms(by_flow["pull"], "handoff_s"),
            "layerwise_handoff_ms": _median_ms(by_flow["layerwise"], "handoff_s"),
        }
    return rows


def _plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    models = list(results["models"])
    fig, axes = plt.subplots(3, len(models), figsize=(6 * len(models), 12), squeeze=False)
    for column, model in enumerate(models):
        rows = results["models"][model]["summary"]
        lengths = list(rows)
        x = np.arange(len(lengths))
        ax = axes[0][column]
        for offset, (key, label) in zip((-0.2, 0.2), (("pull_ttft_ms", "pull"), ("layerwise_ttft_ms", "layerwise"))):
            ax.bar(x + offset, [rows[n][key] for n in lengths], 0.4, label=label)
        ax.set_xticks(x, [str(n) for n in lengths])
        ax.set_title(f"{model}: TTFT ms (median) by prompt tokens")
        ax.legend()
        ax = axes[1][column]
        ax.bar(x - 0.2, [rows[n]["pull_transfer_ms"] for n in lengths], 0.4, label="pull transfer ms")
        ax.bar(x + 0.2, [rows[n]["ttft_saved_ms"] for n in lengths], 0.4, label="TTFT saved ms")
        for i, n in enumerate(lengths):
            ax.annotate(f"overlap {rows[n]['overlap_ratio']:.2f}", (i, 0), ha="center", va="bottom")
        ax.set_xticks(x, [str(n) for n in lengths])
        ax.set_title(f"{model}: pull's transfer vs TTFT saved")
        ax.legend()
        ax = axes[2][column]
        for offset, (key, label) in zip((-0.2, 0.2), (("pull_handoff_ms", "pull"), ("layerwise_handoff_ms", "layerwise"))):
            ax.bar(x + offset, [rows[n][key] for n in lengths], 0.4, label=label)
        ax.axhline(0, color="black", linewidth=0.5)
        ax.set_xticks(x, [str(n) for n in lengths])
        ax.set_title(f"{model}: prefill's answer to first token, ms (median)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=30)  # pairs per length: this machine's TTFTs vary
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 4000])
    parser.add_argument("--output-len", type=int, default=4)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--models-dir", default=str(Path.home() / ".cache" / "pdmesh" / "bench-models"))
    args = parser.parse_args()
    results = {"workload": vars(args), "models": {}}
    for model in args.models:
        model_dir = MODELS[model](Path(args.models_dir) / model)
        with tempfile.TemporaryDirectory() as run_dir, LocalCluster(model_dir, Path(run_dir)) as cluster:
            samples = asyncio.run(_compare(cluster, model_dir, args))
        summary = _summary(samples)
        results["models"][model] = {"summary": summary, "raw": samples}
        for length, row in summary.items():
            print(f"{model} {length:>5} tokens: TTFT pull {row['pull_ttft_ms']:.1f} ms, layerwise "
                  f"{row['layerwise_ttft_ms']:.1f} ms (saved {row['ttft_saved_ms']:.1f} ms = "
                  f"{row['share_of_pull_transfer_saved']:.2f}x pull's transfer of {row['pull_transfer_ms']:.1f} ms); "
                  f"overlap {row['overlap_ratio']:.2f}; target {'met' if row['target_met'] else 'missed'}; "
                  f"paired: saved {row['paired_saved_ms']:.1f} ms, layerwise faster in "
                  f"{row['pairs_layerwise_faster']}/{row['num_pairs']} (target {'met' if row['target_met_paired'] else 'missed'}); "
                  f"prefill call {row['pull_prefill_ms']:.1f} / {row['layerwise_prefill_ms']:.1f} ms, handoff "
                  f"{row['pull_handoff_ms']:.1f} / {row['layerwise_handoff_ms']:.1f} ms")
    json_path = write_results("layerwise", results, REPORT_DIR)
    png_path = json_path.with_suffix(".png")
    _plot(results, png_path)
    print(f"wrote {json_path} and {png_path}")


if __name__ == "__main__":
    main()

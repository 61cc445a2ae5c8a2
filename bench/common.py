"""Helpers shared by the benchmarks: workloads, medians, memcpy baseline, JSON + PNG output."""

from __future__ import annotations

import json
import random
import statistics
import time
from pathlib import Path

import numpy as np

RESULTS_DIR = Path(__file__).resolve().parent / "results"  # scratch runs (ignored by git)
REPORT_DIR = Path(__file__).resolve().parent / "report"    # the committed report's JSON and plots


def random_prompts(num_prompts: int, prompt_len: int, seed: int, vocab_size: int = 1024) -> list[list[int]]:
    rng = random.Random(seed)
    return [[0] + [rng.randrange(3, vocab_size) for _ in range(prompt_len - 1)] for _ in range(num_prompts)]


def memcpy_gbps(nbytes: int = 64 << 20, repeats: int = 7) -> float:
    """Median GB/s of copying a warm buffer into another warm buffer on this machine."""
    src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        np.copyto(dst, src)
        samples.append(nbytes / (time.perf_counter() - started) / 1e9)
    return statistics.median(samples)


def write_results(name: str, results: dict, out_dir: Path = RESULTS_DIR) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(results, indent=2))
    return path


def plot_bars(name: str, panels: list[tuple[str, dict[str, float]]], out_dir: Path = RESULTS_DIR) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4))
    for ax, (title, bars) in zip(np.atleast_1d(axes), panels):
        ax.bar(list(bars), list(bars.values()), color=["#4c72b0", "#dd8452", "#55a868", "#c44e52"][:len(bars)])
        ax.set_title(title)
        for i, value in enumerate(bars.values()):
            ax.annotate(f"{value:.3g}", (i, value), ha="center", va="bottom")
    fig.tight_layout()
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path

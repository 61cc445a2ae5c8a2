"""Runs the arms through the workloads: every arm started fresh for each repeat, the arms' order
turned by one at each repeat (no arm always first, or always after the same one), each arm warmed
up, then every point of every workload in turn. Rows are written after each arm, so a crash loses
only the arm it happened in."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from bench.serving import load_tool, trace
from bench.serving.arms import System, start
from bench.serving.mesh_mix import mix_between, read_counters
from bench.serving.replay import replay
from bench.serving.rows import Row
from bench.serving.workloads import CLOSED, TRACE, WARMUP, Workload
from bench.stamp import RunStamp

SERVED_NAME = "tiny-llama"   # every arm serves the model under this name (pdmesh's EngineSettings default)


def arm_order(arms: Sequence[System], repeat: int) -> list[System]:
    turn = repeat % len(arms) if arms else 0
    return [*arms[turn:], *arms[:turn]]


def run_arm(arm: System, model_dir: Path, workloads: Sequence[Workload], repeat: int, stamp: RunStamp,
            log_dir: Path, timeout_s: float) -> list[Row]:
    rows = []
    started = time.monotonic()
    with start(arm, model_dir, log_dir) as endpoints:
        base_url = endpoints.base_url
        print(f"[{arm.name} #{repeat}] up in {time.monotonic() - started:.0f} s at {base_url}", flush=True)
        _, warmup = measure_point(base_url, model_dir, WARMUP, WARMUP.points[0], timeout_s)
        if warmup["num_failed"]:   # an arm that cannot serve is a broken harness, not a figure
            raise RuntimeError(f"{arm.name} failed {warmup['num_failed']} of {warmup['num_sent']} warm-up requests "
                               f"at {base_url}")
        for workload in workloads:
            for point in workload.points:
                before = read_counters(endpoints.metrics_url) if endpoints.metrics_url else None
                timings, measured = measure_point(base_url, model_dir, workload, point, timeout_s)
                mix = mix_between(before, read_counters(endpoints.metrics_url)) if before is not None else {}
                row = Row.measured(stamp, timings, arm=arm.name, workload=workload.name, kind=workload.kind,
                                   point=point, repeat=repeat, mix=mix, **measured)
                rows.append(row)
                print(f"[{arm.name} #{repeat}] {workload.name} @ {point:g}: {row.summary()}", flush=True)
    return rows


def measure_point(base_url: str, model_dir: Path, workload: Workload, point: float, timeout_s: float):
    """(timings, the Row's measured fields) of one point: vLLM's load tool, or the trace replayer."""
    if workload.kind == TRACE:
        requests = trace.load(trace.TRACES_DIR / workload.trace, workload.num_prompts)
        result = asyncio.run(replay(base_url, SERVED_NAME, requests, point, workload.seed(point),
                                    timeout_s))
        return result.timings, dict(offered_rate=trace.offered_rate(requests, point), num_sent=result.num_sent,
                                    num_failed=result.num_failed, duration_s=result.duration_s,
                                    output_tokens=result.output_tokens)
    raw = load_tool.run_point(base_url, model_dir, SERVED_NAME, workload, point, timeout_s)
    num_sent = raw["completed"] + raw.get("failed", 0)
    offered = raw["request_throughput"] if workload.kind == CLOSED else point
    return load_tool.timings(raw), dict(offered_rate=offered, num_sent=num_sent, num_failed=raw.get("failed", 0),
                                        duration_s=raw["duration"], output_tokens=raw["total_output_tokens"])


def run(arms: Sequence[System], model_dir: Path, workloads: Sequence[Workload], repeats: int, stamp: RunStamp,
        log_dir: Path, timeout_s: float, save: Callable[[list[Row]], None]) -> list[Row]:
    rows: list[Row] = []
    for repeat in range(repeats):
        for arm in arm_order(arms, repeat):
            rows += run_arm(arm, model_dir, workloads, repeat, stamp, log_dir, timeout_s)
            save(rows)
    return rows

"""KV transports between two processes, in one run: GB/s of each (shared memory, Mooncake Transfer
Engine over TCP, gRPC) against memcpy and against raw Mooncake TE, and the handoff latency of a
2-block and a 64-block prompt, one at a time and 32 at once.

python -m bench.bench_kv_transport [--sizes-mib 1,4,16,64,256 --repeats 5 --handoffs 100]

A producer process (core 0) holds transfers of blocks in a real connector worker's paged KV cache
(4 layers of (blocks, 2, 32, 128) float32: 128 KiB blocks, tiny-llama's) and serves them on its KV
port; this process (core 1) reads each through a consumer connector worker forced to one transport:
the same handshake, open, copy, checksum of the landed bytes and release as decode's pull. Raw TE is
the engine's own blocking batch read (`batch_transfer_sync_read`) of the same bytes, one descriptor
per layer, into the consumer's KV cache, nothing else.
Writes bench/report/kv_transport.json and .png.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from bench.common import REPORT_DIR, memcpy_gbps
from bench.peer_process import peer_process, serve_until_released

BLOCK_SIZE = 32
LAYER_SHAPE = (2, BLOCK_SIZE, 128)  # per block: K/V, tokens, heads * head_dim (float32)
NUM_LAYERS = 4
BLOCK_NBYTES = NUM_LAYERS * 2 * BLOCK_SIZE * 128 * 4
TRANSPORTS = ["shm", "mooncake", "grpc"]
HANDOFF_BLOCKS = [2, 64]
CONCURRENCY = 32


def _tokens(num_blocks: int, salt: int) -> list[int]:
    return [(salt * 7919 + i) % 50000 for i in range(num_blocks * BLOCK_SIZE)]


def _worker(model_dir: Path, is_producer: bool, transport: str, num_blocks: int):
    import torch

    from pdmesh.config import KVTransportSettings, TelemetrySettings
    from worker.worker_side import ConnectorWorker

    worker = ConnectorWorker(model=str(model_dir), block_size=BLOCK_SIZE, is_producer=is_producer,
                             kv_host="127.0.0.1", kv_port=0, hold_timeout_s=3600, pull_timeout_s=60,
                             telemetry=TelemetrySettings(), transport=KVTransportSettings(kv_transport=transport, mooncake_host="127.0.0.1"))
    make = torch.randn if is_producer else torch.zeros
    caches = {f"l{i}": make(num_blocks, *LAYER_SHAPE) for i in range(NUM_LAYERS)}
    worker.register_kv_caches(caches, num_blocks)
    return worker, caches


# ---- the producer process ----
def serve(spec_path: Path) -> None:
    from pdmesh.kv.tasks import SendTask
    from tests.kv_task_names import named
    from worker.metadata import PDMeshConnectorMetadata

    spec = json.loads(spec_path.read_text())
    os.sched_setaffinity(0, {0})
    worker, _ = _worker(Path(spec["model_dir"]), True, "auto", spec["num_blocks"])
    sends = [named(worker, SendTask(transfer_id, list(range(num_blocks)), _tokens(num_blocks, salt)))
             for transfer_id, num_blocks, salt in spec["transfers"]]
    worker.start_tasks(PDMeshConnectorMetadata(sends=sends))
    engine = worker.producer.exporters[-1]._engine if worker.producer.exporters else None
    regions = worker._paged.regions()
    serve_until_released(spec, {"address": worker.producer.server.address, "session": engine.session if engine else "",
                                "bases": [r.base for r in regions]})
    worker.shutdown()


# ---- this process ----
def _read(consumer, address: str, transfer_id: str, num_blocks: int, salt: int) -> float:
    """Seconds of one read through the consumer's transport, as decode's pull does it: from the
    start of the pull to the request reported received (the release follows, off its path)."""
    from pdmesh.kv.tasks import RecvTask
    from tests.kv_task_names import named

    task = named(consumer, RecvTask(request_id=transfer_id, pdmesh_request_id=transfer_id, transfer_id=transfer_id,
                                    kv_address=address, block_indexes=list(range(num_blocks)),
                                    local_block_ids=list(range(num_blocks)), token_ids=_tokens(num_blocks, salt)))
    consumer.consumer._receive(task)
    stats = consumer._stats_pending.pop(transfer_id)
    seconds = stats["seconds"]
    consumer._done_recving.discard(transfer_id)
    if stats["num_blocks"] != num_blocks:
        raise RuntimeError(f"{transfer_id}: {stats['num_blocks']} of {num_blocks} blocks landed")
    return seconds


def _raw_te_gbps(engine, session: str, remote_bases: list[int], local_bases: list[int], nbytes: int,
                 repeats: int) -> float:
    per_layer = nbytes // NUM_LAYERS
    samples = []
    for _ in range(repeats + 1):
        started = time.perf_counter()
        status = engine._engine.batch_transfer_sync_read(session, local_bases, remote_bases, [per_layer] * NUM_LAYERS)
        if status != 0:
            raise RuntimeError(f"raw Mooncake read failed ({status})")
        samples.append(nbytes / (time.perf_counter() - started) / 1e9)
    return statistics.median(samples[1:])


def run(args) -> dict:
    sizes = [int(s) for s in args.sizes_mib.split(",")]
    max_blocks = max(sizes) * (1 << 20) // BLOCK_NBYTES
    work = Path(tempfile.mkdtemp(prefix="pdmesh-bench-kv-"))
    (work / "config.json").write_text('{"model_type": "llama"}')
    transfers, salt = [], 0
    plan: dict[tuple[str, str], list[tuple[str, int, int]]] = {}
    for transport in TRANSPORTS:
        for size in sizes:
            items = [(f"{transport}-bw{size}-{i}", size * (1 << 20) // BLOCK_NBYTES, salt + i)
                     for i in range(args.repeats + 1)]
            plan[(transport, f"bw{size}")] = items
            salt += len(items)
        for num_blocks in HANDOFF_BLOCKS:
            for mode, count in (("serial", args.handoffs), ("concurrent", CONCURRENCY * args.rounds)):
                items = [(f"{transport}-h{num_blocks}-{mode}-{i}", num_blocks, salt + i) for i in range(count)]
                plan[(transport, f"h{num_blocks}-{mode}")] = items
                salt += len(items)
    transfers = [item for items in plan.values() for item in items]
    spec = {"model_dir": str(work), "num_blocks": max_blocks, "transfers": transfers}
    with peer_process("bench.bench_kv_transport", spec, work) as served:
        return _measure(args, sizes, plan, served, work, max_blocks)


def _measure(args, sizes, plan, served, work: Path, max_blocks: int) -> dict:
    results = {"block_nbytes": BLOCK_NBYTES, "sizes_mib": sizes, "memcpy_gbps": {}, "raw_te_gbps": {},
               "gbps": {t: {} for t in TRANSPORTS}, "handoff_ms": {t: {} for t in TRANSPORTS}}
    for size in sizes:
        results["memcpy_gbps"][size] = memcpy_gbps(size << 20, args.repeats)
    for transport in TRANSPORTS:
        consumer, _ = _worker(work, False, transport, max_blocks)
        try:
            if transport == "mooncake":
                engine = consumer.consumer.links_for((0, 1))._readers["mooncake"]._engine
                local = [r.base for r in consumer._paged.regions()]
                for size in sizes:
                    results["raw_te_gbps"][size] = _raw_te_gbps(engine, served["session"], served["bases"], local,
                                                                size << 20, args.repeats)
            for size in sizes:
                items = plan[(transport, f"bw{size}")]
                seconds = [_read(consumer, served["address"], *item) for item in items][1:]  # first: warm-up
                results["gbps"][transport][size] = (size << 20) / statistics.median(seconds) / 1e9
            for num_blocks in HANDOFF_BLOCKS:
                results["handoff_ms"][transport][num_blocks] = _handoffs(consumer, served["address"], plan, transport,
                                                                         num_blocks)
            print(transport, json.dumps({k: results[k][transport] for k in ("gbps",)}), flush=True)
        finally:
            consumer.shutdown()
    return results


def _handoffs(consumer, address: str, plan, transport: str, num_blocks: int) -> dict:
    serial = [_read(consumer, address, *item) * 1e3 for item in plan[(transport, f"h{num_blocks}-serial")]]
    items = plan[(transport, f"h{num_blocks}-concurrent")]
    concurrent, walls = [], []
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        for start in range(0, len(items), CONCURRENCY):
            batch = items[start:start + CONCURRENCY]
            started = time.perf_counter()
            concurrent += [s * 1e3 for s in pool.map(lambda item: _read(consumer, address, *item), batch)]
            walls.append(time.perf_counter() - started)
    # Under concurrency a transfer's fair share is the round's rate split 32 ways: the slowest transfer
    # against that share says whether one waits behind the others (1 = none does).
    round_gbps = [CONCURRENCY * num_blocks * BLOCK_NBYTES / wall / 1e9 for wall in walls]
    fair_share_ms = num_blocks * BLOCK_NBYTES / (statistics.median(round_gbps) * 1e9 / CONCURRENCY) * 1e3
    return {"serial_p50": _pct(serial, 50), "serial_p99": _pct(serial, 99),
            "concurrent_p50": _pct(concurrent, 50), "concurrent_p99": _pct(concurrent, 99),
            "concurrent_gbps": statistics.median(round_gbps),
            "slowest_vs_fair_share": max(concurrent) / fair_share_ms, "concurrent_all": concurrent}


def _pct(values: list[float], q: int) -> float:
    return float(np.percentile(values, q))


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    sizes = results["sizes_mib"]
    left.plot(sizes, [results["memcpy_gbps"][s] for s in sizes], "k--", marker="o", label="memcpy")
    left.plot(sizes, [results["raw_te_gbps"][s] for s in sizes], "k:", marker="o", label="raw Mooncake TE")
    for transport in TRANSPORTS:
        left.plot(sizes, [results["gbps"][transport][s] for s in sizes], marker="o", label=f"pdmesh {transport}")
    left.set(xscale="log", yscale="log", xlabel="payload (MiB)", ylabel="GB/s", title="KV read, two processes")
    left.legend()
    labels, values = [], []
    for transport in TRANSPORTS:
        for num_blocks in HANDOFF_BLOCKS:
            for mode in ("serial", "concurrent"):
                labels.append(f"{transport}\n{num_blocks}b {mode[:4]}")
                values.append(results["handoff_ms"][transport][num_blocks][f"{mode}_p50"])
    right.bar(range(len(values)), values)
    right.set_xticks(range(len(values)), labels, fontsize=6)
    right.set(yscale="log", ylabel="handoff p50 (ms)", title=f"handoff latency (concurrent = {CONCURRENCY} at once)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-mib", default="1,4,16,64,256")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--handoffs", type=int, default=100, help="one-at-a-time handoffs per prompt size")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of 32 concurrent handoffs per prompt size")
    parser.add_argument("--out", default=str(REPORT_DIR / "kv_transport"))
    parser.add_argument("--serve", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(Path(args.serve))
        return
    results = run(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for transport in TRANSPORTS:
        for num_blocks in HANDOFF_BLOCKS:
            results["handoff_ms"][transport][num_blocks].pop("concurrent_all")
    out.with_suffix(".json").write_text(json.dumps(results, indent=2))
    plot(results, out.with_suffix(".png"))
    big = max(results["sizes_mib"])
    print(f"at {big} MiB: memcpy {results['memcpy_gbps'][big]:.2f} GB/s, raw TE {results['raw_te_gbps'][big]:.2f}")
    for transport in TRANSPORTS:
        gbps = results["gbps"][transport][big]
        print(f"  {transport:9s} {gbps:.2f} GB/s = {gbps / results['memcpy_gbps'][big]:.2f}x memcpy, "
              f"{gbps / results['raw_te_gbps'][big]:.2f}x raw TE; handoff p50 ms "
              + ", ".join(f"{n}b {h['serial_p50']:.2f}/{h['concurrent_p50']:.2f} (p99 {h['serial_p99']:.2f}/"
                          f"{h['concurrent_p99']:.2f}; slowest {h['slowest_vs_fair_share']:.2f}x its share of "
                          f"{h['concurrent_gbps']:.2f} GB/s)" for n, h in results["handoff_ms"][transport].items()))


if __name__ == "__main__":
    main()

"""A KV store's remote fetch through each transport, in one run: GB/s of loading a prefix another
node's store holds (the node exports it, the loader reads the export like a prefill's KV and
releases it) over shared memory, Mooncake Transfer Engine (TCP) and gRPC, against memcpy and
against the same transport reading a prefill's KV cache straight (no export).

python -m bench.bench_store_fetch [--sizes-mib 1,16,64 --repeats 5]

A holder process (core 0) runs a real producer connector worker with a KV store (DRAM tier) and
saves prompts of 128 KiB blocks (tiny-llama's) into it, holding the same blocks as transfers too;
this process (core 1) runs a producer worker forced to one transport and loads each prompt from the
holder's store the way its engine would (StoreAgent.load, budget off), then reads the same blocks
as a decode pull would.
Writes bench/report/store_fetch.json and .png.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path

from bench.common import REPORT_DIR, memcpy_gbps
from bench.peer_process import peer_process, serve_until_released

BLOCK_SIZE = 32
LAYER_SHAPE = (2, BLOCK_SIZE, 128)
NUM_LAYERS = 4
BLOCK_NBYTES = NUM_LAYERS * 2 * BLOCK_SIZE * 128 * 4
TRANSPORTS = ["shm", "mooncake", "grpc"]


def _tokens(num_blocks: int, salt: int) -> list[int]:
    return [(salt * 7919 + i) % 50000 for i in range(num_blocks * BLOCK_SIZE)]


def _worker(model_dir: Path, transport: str, num_blocks: int, store_bytes: int, is_producer: bool = True):
    import torch

    from pdmesh.config import KVTransportSettings, StoreSettings, TelemetrySettings
    from worker.worker_side import ConnectorWorker

    store = StoreSettings(device_bytes=0, dram_bytes=store_bytes, nvme_bytes=0, export_bytes=store_bytes,
                          fetch_timeout_s=60) if is_producer else None
    worker = ConnectorWorker(model=str(model_dir), block_size=BLOCK_SIZE, is_producer=is_producer,
                             kv_host="127.0.0.1", kv_port=0, hold_timeout_s=3600, pull_timeout_s=60,
                             telemetry=TelemetrySettings(), store=store,
                             transport=KVTransportSettings(kv_transport=transport, mooncake_host="127.0.0.1"))
    make = torch.randn if is_producer else torch.zeros
    worker.register_kv_caches({f"l{i}": make(num_blocks, *LAYER_SHAPE) for i in range(NUM_LAYERS)}, num_blocks)
    return worker


# ---- the holder process ----
def serve(spec_path: Path) -> None:
    from pdmesh.kv.tasks import SendTask
    from tests.kv_task_names import named
    from worker.metadata import PDMeshConnectorMetadata

    spec = json.loads(spec_path.read_text())
    os.sched_setaffinity(0, {0})
    worker = _worker(Path(spec["model_dir"]), "auto", spec["num_blocks"], spec["store_bytes"])
    for name, num_blocks, salt in spec["prompts"]:  # one at a time: a prompt is the whole cache
        send = named(worker, SendTask(name, list(range(num_blocks)), _tokens(num_blocks, salt)))
        worker.start_tasks(PDMeshConnectorMetadata(sends=[send]))
        if not worker.saver.flush(timeout_s=300):
            raise RuntimeError("the store did not save the prompts")
    serve_until_released(spec, {"address": worker.producer.server.address, "blocks": worker.store.store.num_blocks})
    worker.shutdown()


# ---- this process ----
def _load_seconds(loader, node: str, num_blocks: int, salt: int) -> float:
    from pdmesh.kv.tasks import StoreLoadTask
    from tests.kv_task_names import names

    token_ids = _tokens(num_blocks, salt)
    task = StoreLoadTask(request_id="r", pdmesh_request_id="r", token_ids=token_ids, extra_key=b"",
                         block_hashes=names(loader, token_ids), block_indexes=list(range(num_blocks)),
                         local_block_ids=list(range(num_blocks)),
                         nodes=[node] * num_blocks)
    stats = loader.store.load(task, loader._paged.write_blocks)
    if stats.num_blocks != num_blocks:
        raise RuntimeError(f"{stats.num_blocks} of {num_blocks} blocks loaded ({stats})")
    return stats.seconds


def _pull_seconds(consumer, address: str, transfer_id: str, num_blocks: int, salt: int) -> float:
    from pdmesh.kv.tasks import RecvTask
    from tests.kv_task_names import named

    task = named(consumer, RecvTask(request_id=transfer_id, pdmesh_request_id=transfer_id, transfer_id=transfer_id,
                                    kv_address=address, block_indexes=list(range(num_blocks)),
                                    local_block_ids=list(range(num_blocks)), token_ids=_tokens(num_blocks, salt),
                                    report_done=False))
    stats = consumer.consumer._receive_traced(task, _NoSpan())
    if stats.num_blocks != num_blocks:
        raise RuntimeError(f"{transfer_id}: {stats.num_blocks} of {num_blocks} blocks landed")
    return stats.seconds


class _NoSpan:
    def set_attributes(self, attributes) -> None:
        pass

    def record_exception(self, exc) -> None:
        pass


def run(args) -> dict:
    sizes = [int(s) for s in args.sizes_mib.split(",")]
    max_blocks = max(sizes) * (1 << 20) // BLOCK_NBYTES
    store_bytes = (sum(sizes) + max(sizes)) << 20
    work = Path(tempfile.mkdtemp(prefix="pdmesh-bench-store-"))
    (work / "config.json").write_text('{"model_type": "llama"}')
    prompts = [(f"p{size}", size * (1 << 20) // BLOCK_NBYTES, salt) for salt, size in enumerate(sizes)]
    spec = {"model_dir": str(work), "num_blocks": max_blocks, "store_bytes": store_bytes, "prompts": prompts}
    with peer_process("bench.bench_store_fetch", spec, work) as served:
        return _measure(args, sizes, prompts, served, work, max_blocks)


def _measure(args, sizes: list[int], prompts, served: dict, work: Path, max_blocks: int) -> dict:
    results = {"block_nbytes": BLOCK_NBYTES, "sizes_mib": sizes, "memcpy_gbps": {},
               "fetch_gbps": {t: {} for t in TRANSPORTS}, "pull_gbps": {t: {} for t in TRANSPORTS}}
    for size in sizes:
        results["memcpy_gbps"][size] = memcpy_gbps(size << 20, args.repeats)
    for transport in TRANSPORTS:
        loader = _worker(work, transport, max_blocks, 1 << 20)
        consumer = _worker(work, transport, max_blocks, 0, is_producer=False)
        try:
            for name, num_blocks, salt in prompts:
                size = num_blocks * BLOCK_NBYTES >> 20
                fetches = [_load_seconds(loader, served["address"], num_blocks, salt)
                           for _ in range(args.repeats + 1)][1:]  # first: handshake, warm-up
                pulls = [_pull_seconds(consumer, served["address"], name, num_blocks, salt)
                         for _ in range(args.repeats + 1)][1:]
                results["fetch_gbps"][transport][size] = (size << 20) / statistics.median(fetches) / 1e9
                results["pull_gbps"][transport][size] = (size << 20) / statistics.median(pulls) / 1e9
            print(transport, json.dumps({k: results[k][transport] for k in ("fetch_gbps", "pull_gbps")}), flush=True)
        finally:
            loader.shutdown()
            consumer.shutdown()
    return results


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axis = plt.subplots(figsize=(7, 4.5))
    sizes = results["sizes_mib"]
    axis.plot(sizes, [results["memcpy_gbps"][s] for s in sizes], "k--", marker="o", label="memcpy")
    for transport in TRANSPORTS:
        line, = axis.plot(sizes, [results["fetch_gbps"][transport][s] for s in sizes], marker="o",
                          label=f"store fetch, {transport}")
        axis.plot(sizes, [results["pull_gbps"][transport][s] for s in sizes], ":", marker="x",
                  color=line.get_color(), label=f"KV pull, {transport}")
    axis.set(xscale="log", yscale="log", xlabel="prefix (MiB)", ylabel="GB/s",
             title="another node's KV store: export + read, vs a straight KV pull")
    axis.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-mib", default="1,16,64")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=str(REPORT_DIR / "store_fetch"))
    parser.add_argument("--serve", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(Path(args.serve))
        return
    results = run(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(results, indent=2))
    plot(results, out.with_suffix(".png"))
    for transport in TRANSPORTS:
        print(f"{transport:9s} " + ", ".join(
            f"{size} MiB fetch {results['fetch_gbps'][transport][size]:.2f} GB/s = "
            f"{results['fetch_gbps'][transport][size] / results['pull_gbps'][transport][size]:.2f}x its pull, "
            f"{results['fetch_gbps'][transport][size] / results['memcpy_gbps'][size]:.2f}x memcpy"
            for size in results["sizes_mib"]))


if __name__ == "__main__":
    main()

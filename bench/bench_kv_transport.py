"""KV transport throughput: gRPC KV server -> receiver over loopback TCP vs memcpy, in one run.

python -m bench.bench_kv_transport [--total-mib 64 --block-kib 1024 --repeats 5]
Moves `total-mib` of blocks through the same servicer, chunking, checksum and reassembly the
connector uses (no vLLM), and prints median GB/s of each path and the ratio to memcpy.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from bench.common import memcpy_gbps, plot_bars, write_results
from pdmesh.transport.checksum import block_checksum
from pdmesh.transport.grpc_kv_receiver import GrpcKVReceiver
from pdmesh.transport.grpc_kv_server import GrpcKVServer, KVTransferServicer
from pdmesh.transport.held_transfers import HeldTransfer, HeldTransfers
from pdmesh.v1 import common_pb2


def _pull_once(receiver: GrpcKVReceiver, address: str, held: HeldTransfers, transfer_id: str,
               num_blocks: int) -> float:
    held.hold(HeldTransfer(transfer_id, tuple(range(num_blocks)), (b"",) * num_blocks, deadline=1e18))
    started = time.perf_counter()
    num_bytes = sum(len(block.payload) for block in receiver.pull(address, transfer_id, range(num_blocks)))
    receiver.release(address, transfer_id)
    return num_bytes / (time.perf_counter() - started) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--total-mib", type=int, default=64)
    parser.add_argument("--block-kib", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    block_nbytes = args.block_kib * 1024
    num_blocks = args.total_mib * 1024 // args.block_kib
    pool = np.random.default_rng(0).integers(0, 255, (num_blocks, block_nbytes), dtype=np.uint8)
    compat = common_pb2.CompatInfo(model_fingerprint="bench", block_nbytes=block_nbytes)
    held = HeldTransfers()
    server = GrpcKVServer(KVTransferServicer(compat, held, lambda block_ids: pool[block_ids]),
                          "127.0.0.1", 0)
    receiver = GrpcKVReceiver(compat)
    try:
        _pull_once(receiver, server.address, held, "warm-up", num_blocks)
        grpc_gbps = [_pull_once(receiver, server.address, held, f"t{i}", num_blocks) for i in range(args.repeats)]
    finally:
        receiver.close()
        server.stop(0)
    started = time.perf_counter()
    for block in pool:
        block_checksum(block)
    checksum_gbps = pool.nbytes / (time.perf_counter() - started) / 1e9
    memcpy = memcpy_gbps(nbytes=min(pool.nbytes, 64 << 20))
    grpc_median = statistics.median(grpc_gbps)
    results = {"workload": vars(args), "grpc_loopback_gbps_median": grpc_median, "grpc_gbps_samples": grpc_gbps,
               "xxh3_checksum_gbps": checksum_gbps, "memcpy_gbps_median": memcpy,
               "grpc_over_memcpy": grpc_median / memcpy}
    json_path = write_results("kv_transport", results)
    png_path = plot_bars("kv_transport", [("GB/s", {"gRPC KV pull": grpc_median, "xxh3": checksum_gbps,
                                                    "memcpy": memcpy})])
    print(f"gRPC KV pull {grpc_median:.3f} GB/s (median of {args.repeats}) | xxh3 {checksum_gbps:.2f} GB/s | "
          f"memcpy {memcpy:.2f} GB/s | gRPC/memcpy {grpc_median / memcpy:.3f}")
    print(f"wrote {json_path} and {png_path}")


if __name__ == "__main__":
    main()

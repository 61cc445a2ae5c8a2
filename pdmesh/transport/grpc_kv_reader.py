"""The gRPC transport's reader: the producer streams the blocks' bytes; each message's blocks land
with one call of `write_rows` (one scatter per layer)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from pdmesh.errors import BlockHashMismatch, WorkerFailed
from pdmesh.transport.chunking import rows_of
from pdmesh.transport.grpc_kv_receiver import GrpcKVReceiver
from pdmesh.transport.kv_transport import GRPC, PeerLink, ReadOptions

RowWriter = Callable[[list[int], np.ndarray], None]  # local block ids, their (n, block_nbytes) uint8 rows


class GrpcKVReader:
    transport = GRPC

    def __init__(self, control: GrpcKVReceiver, write_rows: RowWriter) -> None:
        self._control = control
        self._write_rows = write_rows

    def read_blocks(self, link: PeerLink, transfer_id: str, block_indexes: Sequence[int],
                    local_block_ids: Sequence[int], expected_hashes: Sequence[bytes],
                    options: ReadOptions = ReadOptions()) -> Iterator[int]:
        num_landed = 0
        for blocks in self._control.pull_runs(link.address, transfer_id, block_indexes, options.verify, options.tamper):
            error = _first_wrong(blocks, block_indexes, expected_hashes, num_landed)
            good = blocks if error is None else blocks[:error[0]]
            if good:  # the blocks before a wrong one still land
                self._write_rows(list(local_block_ids[num_landed:num_landed + len(good)]), rows_of(blocks)[:len(good)])
                num_landed += len(good)
                yield num_landed
                if options.stall_s and num_landed == len(good):
                    time.sleep(options.stall_s)
            if error is not None:
                raise error[1]

    def close(self) -> None:
        return None


def _first_wrong(blocks, block_indexes: Sequence[int], expected_hashes: Sequence[bytes], num_before: int):
    """(offset, error) of the first block out of order or holding other tokens; None if all fit."""
    for offset, block in enumerate(blocks):
        if block.block_index != block_indexes[num_before + offset]:
            return offset, WorkerFailed(f"block {block.block_index} arrived out of order")
        if block.block_hash != expected_hashes[block.block_index]:
            return offset, BlockHashMismatch(f"block {block.block_index} holds other tokens than the request's")
    return None

"""The gRPC transport's reader: the producer streams the blocks' bytes; each message's blocks land
with one call of `write_rows` (one scatter per layer). In the layer-wise flow it reads the layers
prefill has written so far, a message of whole layer runs at a time."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from decode.kv.kv_port_client import KVPortClient
from pdmesh.errors import BlockHashMismatch, WorkerFailed
from pdmesh.kv.checksum import piece_digest
from pdmesh.kv.kv_layout import digest_matrix, piece_columns
from pdmesh.transport.chunking import rows_of
from pdmesh.transport.kv_transport import GRPC, PeerLink, ReadOptions

RowWriter = Callable[..., None]  # local block ids, their (n, block_nbytes) uint8 rows[, layers]


class GrpcKVReader:
    transport = GRPC

    def __init__(self, control: KVPortClient, write_rows: RowWriter,
                 pieces: Sequence[tuple[int, int]] = ()) -> None:
        """pieces: (num_parts, part_nbytes) of each layer of a block, as it travels (layer-wise reads
        hash each landed piece, like the registered-memory readers)."""
        self._control = control
        self._write_rows = write_rows
        self._pieces = list(pieces)

    def digest_matrix(self, num_blocks: int) -> np.ndarray:
        return digest_matrix([num_parts for num_parts, _ in self._pieces], num_blocks)

    def piece_columns(self, layers: range) -> list[int]:
        return piece_columns([num_parts for num_parts, _ in self._pieces], layers)

    def land_layers(self, link: PeerLink, transfer_id: str, block_indexes: Sequence[int], src_ids: Sequence[int],
                    dst_ids: Sequence[int], layers: range, digests: np.ndarray | None,
                    options: ReadOptions = ReadOptions()) -> None:
        """`layers` of the transfer's blocks at block_indexes into local blocks dst_ids, their pieces'
        hashes into those layers' columns of `digests` (a row per block; None: not verifying)."""
        columns = self.piece_columns(layers)
        offsets = np.cumsum([0, *(part_nbytes for num_parts, part_nbytes in self._pieces[layers.start:layers.stop]
                                  for _ in range(num_parts))]).tolist()  # each piece's bytes in a row
        num_landed = 0
        for blocks in self._control.pull_runs(link.address, transfer_id, block_indexes, options.verify,
                                              options.tamper, layers):
            rows = rows_of(blocks)
            self._write_rows(list(dst_ids[num_landed:num_landed + len(blocks)]), rows, layers)
            if digests is not None:
                for row_index, row in enumerate(rows):
                    digests[num_landed + row_index, columns] = [
                        piece_digest(row[start:end]) for start, end in zip(offsets, offsets[1:])]
            num_landed += len(blocks)

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

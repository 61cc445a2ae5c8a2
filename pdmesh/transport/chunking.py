"""Splits KV blocks into wire chunks and reassembles them, verifying each block's checksum (the one
definition, pdmesh/kv/checksum.py: both ends give the blocks' piece sizes; None: one piece).

Blocks of at most half a chunk travel as runs (several whole blocks per message); larger ones are
split into pieces. Every message a receiving thread waits for costs a GIL hand-off in a process
whose model runner holds the GIL most of the time, so fewer, larger messages matter more than
the bytes.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import grpc
import numpy as np

from pdmesh.errors import ChecksumMismatch, InvalidRequest, WorkerFailed
from pdmesh.kv.checksum import block_checksum
from pdmesh.status_map import error_from_rpc_error
from pdmesh.v1 import kv_transfer_pb2

DEFAULT_CHUNK_NBYTES = 1 << 20  # 1 MiB: below gRPC's 4 MiB default, and faster than 4 MiB here
MAX_CHUNK_NBYTES = 4 << 20


def iter_block_chunks(
    block_index: int,
    payload: bytes | memoryview,
    block_hash: bytes,
    chunk_nbytes: int = DEFAULT_CHUNK_NBYTES,
    piece_nbytes: Sequence[int] | None = None,
) -> Iterator[kv_transfer_pb2.KVChunk]:
    """Yields the chunks of one block; the last one carries checksum and content hash."""
    view = memoryview(payload).cast("B")
    block_nbytes = view.nbytes
    checksum = block_checksum(view, piece_nbytes)
    offset = 0
    while True:
        end = min(offset + chunk_nbytes, block_nbytes)
        last = end == block_nbytes
        yield kv_transfer_pb2.KVChunk(
            block_index=block_index,
            offset=offset,
            data=view[offset:end].tobytes(),
            block_nbytes=block_nbytes,
            last=last,
            checksum=checksum if last else 0,
            block_hash=block_hash if last else b"",
        )
        if last:
            return
        offset = end


def iter_chunks(block_indexes: Sequence[int], rows: np.ndarray, block_hashes: Sequence[bytes],
                chunk_nbytes: int = DEFAULT_CHUNK_NBYTES,
                piece_nbytes: Sequence[int] | None = None) -> Iterator[kv_transfer_pb2.KVChunk]:
    """The chunks of blocks whose bytes are `rows` ((n, block_nbytes) uint8): runs of whole blocks
    while two or more fit in a chunk, pieces of each block otherwise."""
    block_nbytes = rows.shape[1]
    per_chunk = blocks_per_chunk(block_nbytes, chunk_nbytes)
    if per_chunk < 2:
        for index, row, block_hash in zip(block_indexes, rows, block_hashes):
            yield from iter_block_chunks(index, row, block_hash, chunk_nbytes, piece_nbytes)
        return
    for start in range(0, len(block_indexes), per_chunk):
        yield run_chunk(block_indexes[start:start + per_chunk], rows[start:start + per_chunk].tobytes(), block_nbytes,
                        block_hashes[start:start + per_chunk], piece_nbytes)


def run_chunk(block_indexes: Sequence[int], data: bytes, block_nbytes: int, block_hashes: Sequence[bytes],
              piece_nbytes: Sequence[int] | None = None) -> kv_transfer_pb2.KVChunk:
    """One message of whole blocks whose bytes are `data` (back to back), each checksummed."""
    view = memoryview(data)
    return kv_transfer_pb2.KVChunk(
        data=data, block_nbytes=block_nbytes, run_block_indexes=block_indexes,
        run_checksums=[block_checksum(view[i:i + block_nbytes], piece_nbytes) for i in range(0, len(data), block_nbytes)],
        run_block_hashes=block_hashes)


def blocks_per_chunk(block_nbytes: int, chunk_nbytes: int = DEFAULT_CHUNK_NBYTES) -> int:
    """How many blocks a sender should read at once to fill its chunks (at least one)."""
    return max(1, chunk_nbytes // block_nbytes)


@dataclass
class AssembledBlock:
    block_index: int
    payload: bytearray | memoryview  # writable
    block_hash: bytes


class BlockAssembler:
    """Collects chunks in stream order; returns a block once its last chunk verified."""

    def __init__(self, max_block_nbytes: int, verify: bool = True, tamper=None,
                 piece_nbytes: Sequence[int] | None = None) -> None:
        self._max_block_nbytes = max_block_nbytes
        self._piece_nbytes = piece_nbytes
        self._verify = verify
        self._tamper = tamper  # fault tests: alters the bytes as they arrive, before the checksum
        self._block_index: int | None = None
        self._buffer = bytearray()
        self._num_received = 0

    def add(self, chunk: kv_transfer_pb2.KVChunk) -> list[AssembledBlock]:
        """The blocks this chunk completes (verified), in order: none, one, or a run's."""
        if chunk.run_block_indexes:
            return self._run(chunk)
        self._start_block_if_new(chunk)
        end = chunk.offset + len(chunk.data)
        if chunk.offset != self._num_received or end > len(self._buffer):
            raise InvalidRequest(
                f"block {chunk.block_index}: chunk at offset {chunk.offset} out of order or too long")
        self._buffer[chunk.offset:end] = chunk.data
        self._num_received = end
        if not chunk.last:
            return []
        return [self._finish(chunk)]

    def _run(self, chunk: kv_transfer_pb2.KVChunk) -> list[AssembledBlock]:
        indexes, block_nbytes = chunk.run_block_indexes, chunk.block_nbytes
        if self._block_index is not None:
            raise InvalidRequest(f"block {self._block_index} ended without its last chunk")
        if not 0 < block_nbytes <= self._max_block_nbytes:
            raise InvalidRequest(f"run at block {indexes[0]}: size {block_nbytes} outside (0, "
                                 f"{self._max_block_nbytes}]")
        if (len(chunk.data) != len(indexes) * block_nbytes or len(chunk.run_checksums) != len(indexes)
                or len(chunk.run_block_hashes) != len(indexes)):
            raise InvalidRequest(f"run at block {indexes[0]}: {len(chunk.data)} bytes, {len(chunk.run_checksums)} "
                                 f"checksums and {len(chunk.run_block_hashes)} hashes for {len(indexes)} blocks")
        data = memoryview(bytearray(chunk.data))  # one writable copy per run: it lands in torch tensors
        if self._tamper is not None:
            self._tamper(data)
        blocks = []
        for i, (index, checksum, block_hash) in enumerate(zip(indexes, chunk.run_checksums, chunk.run_block_hashes)):
            payload = data[i * block_nbytes:(i + 1) * block_nbytes]
            actual = self._checksum(payload) if self._verify else checksum
            if actual != checksum:
                raise ChecksumMismatch(f"block {index}: checksum {actual:#018x} != sent {checksum:#018x}")
            blocks.append(AssembledBlock(index, payload, bytes(block_hash)))
        return blocks

    def _checksum(self, payload) -> int:
        try:
            return block_checksum(payload, self._piece_nbytes)
        except ValueError as exc:   # not a block of the agreed pieces: its bytes cannot be the producer's
            raise ChecksumMismatch(f"block of {len(payload)} bytes: {exc}") from exc

    @property
    def in_progress(self) -> bool:
        return self._block_index is not None

    def _start_block_if_new(self, chunk: kv_transfer_pb2.KVChunk) -> None:
        if self._block_index == chunk.block_index:
            return
        if self._block_index is not None:
            raise InvalidRequest(f"block {self._block_index} ended without its last chunk")
        if not 0 < chunk.block_nbytes <= self._max_block_nbytes:
            raise InvalidRequest(
                f"block {chunk.block_index}: size {chunk.block_nbytes} outside (0, {self._max_block_nbytes}]")
        self._block_index = chunk.block_index
        self._buffer = bytearray(chunk.block_nbytes)
        self._num_received = 0

    def _finish(self, chunk: kv_transfer_pb2.KVChunk) -> AssembledBlock:
        if self._num_received != len(self._buffer):
            raise InvalidRequest(
                f"block {chunk.block_index}: got {self._num_received} of {len(self._buffer)} bytes")
        if self._tamper is not None:
            self._tamper(memoryview(self._buffer))
        actual = self._checksum(self._buffer) if self._verify else chunk.checksum
        if actual != chunk.checksum:
            raise ChecksumMismatch(
                f"block {chunk.block_index}: checksum {actual:#018x} != sent {chunk.checksum:#018x}")
        block = AssembledBlock(chunk.block_index, self._buffer, bytes(chunk.block_hash))
        self._block_index = None
        self._buffer = bytearray()
        return block


def receive_runs(chunks: Iterable[kv_transfer_pb2.KVChunk], max_block_nbytes: int, num_expected: int,
                 what: str, verify: bool = True, tamper=None,
                 piece_nbytes: Sequence[int] | None = None) -> Iterator[list[AssembledBlock]]:
    """Yields verified blocks from a chunk stream, a message's worth at a time (a run, or the one
    block its last piece completed); raises a domain error on any failure, including a stream that
    ended before `num_expected` blocks."""
    assembler = BlockAssembler(max_block_nbytes, verify, tamper, piece_nbytes)
    num_blocks = 0
    try:
        for chunk in chunks:
            blocks = assembler.add(chunk)
            if blocks:
                num_blocks += len(blocks)
                yield blocks
    except grpc.RpcError as exc:
        raise error_from_rpc_error(exc) from exc
    if num_blocks != num_expected or assembler.in_progress:
        raise WorkerFailed(f"{what}: got {num_blocks} of {num_expected} blocks")


def receive_blocks(chunks: Iterable[kv_transfer_pb2.KVChunk], max_block_nbytes: int, num_expected: int,
                   what: str) -> Iterator[AssembledBlock]:
    """receive_runs, one block at a time."""
    for blocks in receive_runs(chunks, max_block_nbytes, num_expected, what):
        yield from blocks


def rows_of(blocks: list[AssembledBlock]) -> np.ndarray:
    """The (n, block_nbytes) uint8 rows of what one message delivered (receive_runs), without a copy:
    a run's blocks are back to back in one buffer."""
    first = blocks[0].payload
    base = first.obj if isinstance(first, memoryview) else first
    rows = np.frombuffer(base, dtype=np.uint8).reshape(len(blocks), -1)
    if rows.shape[1] != len(first):
        raise ValueError(f"blocks of {len(first)} bytes are not one run of {len(blocks)}")
    return rows

"""Splits KV blocks into wire chunks and reassembles them, verifying each block's checksum."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import grpc

from pdmesh.errors import ChecksumMismatch, InvalidRequest, WorkerFailed
from pdmesh.status_map import error_from_rpc_error
from pdmesh.transport.checksum import block_checksum
from pdmesh.v1 import kv_transfer_pb2

DEFAULT_CHUNK_NBYTES = 1 << 20  # 1 MiB: below gRPC's 4 MiB default, and faster than 4 MiB here
MAX_CHUNK_NBYTES = 4 << 20


def iter_block_chunks(
    block_index: int,
    payload: bytes | memoryview,
    block_hash: bytes,
    chunk_nbytes: int = DEFAULT_CHUNK_NBYTES,
) -> Iterator[kv_transfer_pb2.KVChunk]:
    """Yields the chunks of one block; the last one carries checksum and content hash."""
    view = memoryview(payload).cast("B")
    block_nbytes = view.nbytes
    checksum = block_checksum(view)
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


@dataclass
class AssembledBlock:
    block_index: int
    payload: bytearray
    block_hash: bytes


class BlockAssembler:
    """Collects chunks in stream order; returns a block once its last chunk verified."""

    def __init__(self, max_block_nbytes: int) -> None:
        self._max_block_nbytes = max_block_nbytes
        self._block_index: int | None = None
        self._buffer = bytearray()
        self._num_received = 0

    def add(self, chunk: kv_transfer_pb2.KVChunk) -> AssembledBlock | None:
        self._start_block_if_new(chunk)
        end = chunk.offset + len(chunk.data)
        if chunk.offset != self._num_received or end > len(self._buffer):
            raise InvalidRequest(
                f"block {chunk.block_index}: chunk at offset {chunk.offset} out of order or too long")
        self._buffer[chunk.offset:end] = chunk.data
        self._num_received = end
        if not chunk.last:
            return None
        return self._finish(chunk)

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
        actual = block_checksum(self._buffer)
        if actual != chunk.checksum:
            raise ChecksumMismatch(
                f"block {chunk.block_index}: checksum {actual:#018x} != sent {chunk.checksum:#018x}")
        block = AssembledBlock(chunk.block_index, self._buffer, bytes(chunk.block_hash))
        self._block_index = None
        self._buffer = bytearray()
        return block


def receive_blocks(chunks: Iterable[kv_transfer_pb2.KVChunk], max_block_nbytes: int, num_expected: int,
                   what: str) -> Iterator[AssembledBlock]:
    """Yields verified blocks from a chunk stream; raises a domain error on any failure,
    including a stream that ended before `num_expected` blocks."""
    assembler = BlockAssembler(max_block_nbytes)
    num_blocks = 0
    try:
        for chunk in chunks:
            block = assembler.add(chunk)
            if block is not None:
                num_blocks += 1
                yield block
    except grpc.RpcError as exc:
        raise error_from_rpc_error(exc) from exc
    if num_blocks != num_expected or assembler.in_progress:
        raise WorkerFailed(f"{what}: got {num_blocks} of {num_expected} blocks")

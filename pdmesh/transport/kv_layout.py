"""Where each block of a paged KV cache lives in memory, and the copies that move blocks between
two caches: what the registered-memory transports (shared memory, Mooncake) exchange at handshake.

A layer's block `b` is `num_parts` pieces (K and V when a layer keeps them apart, else one) of
`part_nbytes` each, at `base + part * part_stride + b * block_stride`. A block's bytes, in wire
order, are its layers' pieces in layer order: the bytes the gRPC path sends and checksums.
No torch here: both ends and the benchmarks describe memory with plain numbers.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

from pdmesh.v1 import kv_transfer_pb2


@dataclass(frozen=True)
class LayerRegion:
    base: int           # address in its process (Mooncake) or byte offset in `shm_path` (shared memory)
    nbytes: int         # bytes from base that hold the layer (what is registered or mapped)
    block_stride: int
    part_stride: int
    num_parts: int
    part_nbytes: int
    shm_path: str = ""  # shared memory: the file that holds the layer

    @property
    def block_nbytes(self) -> int:
        return self.num_parts * self.part_nbytes

    def offset(self, block_id: int, part: int) -> int:
        """Byte offset of a block's piece from base."""
        return part * self.part_stride + block_id * self.block_stride

    def to_proto(self) -> kv_transfer_pb2.LayerRegion:
        return kv_transfer_pb2.LayerRegion(
            base=self.base, nbytes=self.nbytes, block_stride=self.block_stride, part_stride=self.part_stride,
            num_parts=self.num_parts, part_nbytes=self.part_nbytes, shm_path=self.shm_path)

    @classmethod
    def from_proto(cls, message: kv_transfer_pb2.LayerRegion) -> "LayerRegion":
        return cls(base=message.base, nbytes=message.nbytes, block_stride=message.block_stride,
                   part_stride=message.part_stride, num_parts=message.num_parts,
                   part_nbytes=message.part_nbytes, shm_path=message.shm_path)


@dataclass(frozen=True)
class Copy:
    """One contiguous copy: `nbytes` from offset `src` of the source layer to offset `dst` of the
    destination layer (offsets from each region's base)."""

    layer: int
    src: int
    dst: int
    nbytes: int


def check_same_shape(src: Sequence[LayerRegion], dst: Sequence[LayerRegion]) -> None:
    """The two caches hold blocks of the same pieces (block ids and strides may differ)."""
    if [(r.num_parts, r.part_nbytes) for r in src] != [(r.num_parts, r.part_nbytes) for r in dst]:
        raise ValueError("the two KV caches split their blocks differently")


def contiguous_runs(src_ids: Sequence[int], dst_ids: Sequence[int]) -> Iterator[tuple[int, int, int]]:
    """(src first, dst first, length) of the runs where both id lists count up by one together."""
    start = 0
    for i in range(1, len(src_ids) + 1):
        if i == len(src_ids) or src_ids[i] != src_ids[i - 1] + 1 or dst_ids[i] != dst_ids[i - 1] + 1:
            yield src_ids[start], dst_ids[start], i - start
            start = i


def copy_plan(src: Sequence[LayerRegion], dst: Sequence[LayerRegion], src_ids: Sequence[int],
              dst_ids: Sequence[int]) -> list[Copy]:
    """The copies that move blocks src_ids[i] into dst_ids[i]: one per layer, piece and run of blocks
    contiguous on both sides (where a layer's pieces of consecutive blocks are back to back), else
    one per block."""
    check_same_shape(src, dst)
    copies = []
    for layer, (s, d) in enumerate(zip(src, dst)):
        mergeable = s.block_stride == s.part_nbytes and d.block_stride == d.part_nbytes
        runs = (contiguous_runs(src_ids, dst_ids) if mergeable
                else ((a, b, 1) for a, b in zip(src_ids, dst_ids)))
        for src_first, dst_first, length in runs:
            for part in range(s.num_parts):
                copies.append(Copy(layer, s.offset(src_first, part), d.offset(dst_first, part),
                                   length * s.part_nbytes))
    return copies


def block_checksums(layers: Sequence[np.ndarray], regions: Sequence[LayerRegion],
                    block_ids: Sequence[int]) -> list[int]:
    """xxh3-64 of each block's wire bytes, read in place from `layers` (each a flat uint8 view of its
    region from base): the value the gRPC path computes over the gathered row, without gathering."""
    checksums = []
    for block_id in block_ids:
        hasher = xxhash.xxh3_64()
        for view, region in zip(layers, regions):
            for part in range(region.num_parts):
                start = region.offset(block_id, part)
                hasher.update(view[start:start + region.part_nbytes])
        checksums.append(hasher.intdigest())
    return checksums

"""Where each block of a paged KV cache lives in memory, and the copies that move blocks between
two caches: what the registered-memory transports (shared memory, Mooncake) exchange at handshake.

A layer's block `b` is `num_parts` pieces (K and V when a layer keeps them apart, else one) of
`part_nbytes` each, at `base + part * part_stride + b * block_stride`. A block's bytes, in wire
order, are its layers' pieces in layer order: the bytes the gRPC path sends. The registered-memory
transports checksum a block piece by piece (pdmesh/kv/checksum.py, the one definition), so a
reader can hash each piece while it is still in cache from the copy that landed it.
No torch here: both ends and the benchmarks describe memory with plain numbers.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from pdmesh.kv.checksum import block_checksum, combine, piece_digest, pieces_of
from pdmesh.v1 import kv_transfer_pb2

WHOLE = (0, 1)  # head_slice (j, k): the j-th of k equal head ranges of each piece; WHOLE: every head


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
    destination layer (offsets from each region's base): piece `part` of the blocks from position
    `first` in the id lists on."""

    layer: int
    src: int
    dst: int
    nbytes: int
    first: int = 0
    part: int = 0


def slab_regions(base: int, num_slots: int, pieces: Sequence[tuple[int, int]], shm_path: str = "") -> list[LayerRegion]:
    """The regions of a slab laid out like a KV cache with `num_slots` blocks, layer after layer
    and, within a layer, part after part ((num_parts, part_nbytes) `pieces` per layer): consecutive
    slots are back to back, so runs of them move as one copy. How a KV store's export slab is read."""
    regions, offset = [], 0
    for num_parts, part_nbytes in pieces:
        regions.append(LayerRegion(base=base + offset, nbytes=num_parts * num_slots * part_nbytes,
                                   block_stride=part_nbytes, part_stride=num_slots * part_nbytes,
                                   num_parts=num_parts, part_nbytes=part_nbytes, shm_path=shm_path))
        offset += num_parts * num_slots * part_nbytes
    return regions


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
        first = 0
        for src_first, dst_first, length in runs:
            for part in range(s.num_parts):
                copies.append(Copy(layer, s.offset(src_first, part), d.offset(dst_first, part),
                                   length * s.part_nbytes, first, part))
            first += length
    return copies


def piece_index(regions: Sequence[LayerRegion]) -> list[int]:
    """For each layer, the position of its first piece among a block's pieces."""
    starts, total = [], 0
    for region in regions:
        starts.append(total)
        total += region.num_parts
    return starts


def digest_matrix(parts_per_layer: Sequence[int], num_blocks: int) -> np.ndarray:
    """Landed-piece hashes of `num_blocks` blocks: a row per block, a column per piece in wire order
    (a layer has parts_per_layer[layer] pieces)."""
    return np.zeros((num_blocks, sum(parts_per_layer)), dtype=np.uint64)


def piece_columns(parts_per_layer: Sequence[int], layers: range) -> list[int]:
    """The columns of a digest matrix that hold `layers`' pieces."""
    starts = np.cumsum([0, *parts_per_layer]).tolist()
    return [column for layer in layers for column in range(starts[layer], starts[layer + 1])]


def first_difference(got: Sequence, want: Sequence) -> int | None:
    """The first position where two aligned sequences differ (None: none, over the shorter)."""
    return next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)


def block_checksums(layers: Sequence[np.ndarray], regions: Sequence[LayerRegion],
                    block_ids: Sequence[int]) -> list[int]:
    """Each block's checksum, read in place from `layers` (each a flat uint8 view of its region from
    base): no gather."""
    digests = np.empty((len(block_ids), sum(r.num_parts for r in regions)), dtype=np.uint64)
    digest, views = piece_digest, [memoryview(view) for view in layers]  # slices cheaper than numpy's
    column = 0
    for view, region in zip(views, regions):
        for part in range(region.num_parts):
            starts = [region.offset(block_id, part) for block_id in block_ids]
            digests[:, column] = [digest(view[start:start + region.part_nbytes]) for start in starts]
            column += 1
    return combine(digests)


def piece_sizes(regions: Sequence[LayerRegion]) -> list[list[int]]:
    """Each layer's pieces' byte counts, in wire order (a block of these regions: all of them in turn)."""
    return [[region.part_nbytes] * region.num_parts for region in regions]


def row_checksums(rows: np.ndarray, regions: Sequence[LayerRegion]) -> list[int]:
    """block_checksums of gathered wire rows ((n, block_nbytes) uint8)."""
    piece_nbytes = pieces_of(piece_sizes(regions))
    return [block_checksum(row, piece_nbytes) for row in rows]

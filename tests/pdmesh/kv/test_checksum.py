"""One checksum of a block, whichever way it travels or rests: the paged cache's in-place
checksums, a gathered row's, a gRPC message's and a store tier's agree; and each catches a flip."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.block_key import BlockKey
from kvstore.block_store import TieredBlockStore
from kvstore.slab_tier import host_tier
from kvstore.store_events import BlockPlaced
from pdmesh.errors import ChecksumMismatch
from pdmesh.kv.checksum import block_checksum, pieces_of
from pdmesh.kv.kv_layout import LayerRegion, block_checksums, piece_sizes, row_checksums
from pdmesh.transport.chunking import BlockAssembler, iter_chunks

NUM_BLOCKS = 4
# two layers: one keeps K and V apart (2 pieces of 64 bytes), one together (1 piece of 96)
REGIONS = [LayerRegion(base=0, nbytes=NUM_BLOCKS * 128, block_stride=128, part_stride=64, num_parts=2,
                       part_nbytes=64, shm_path=""),
           LayerRegion(base=0, nbytes=NUM_BLOCKS * 96, block_stride=96, part_stride=0, num_parts=1,
                       part_nbytes=96, shm_path="")]
PIECES = piece_sizes(REGIONS)
BLOCK_NBYTES = 224


def _cache() -> tuple[list[np.ndarray], np.ndarray]:
    """Each layer's flat bytes (block b's pieces back to back at b * stride), and the blocks' wire rows."""
    rng = np.random.default_rng(7)
    layers = [rng.integers(0, 256, NUM_BLOCKS * 128, dtype=np.uint8), rng.integers(0, 256, NUM_BLOCKS * 96, dtype=np.uint8)]
    rows = np.stack([np.concatenate([layers[0][b * 128:(b + 1) * 128], layers[1][b * 96:(b + 1) * 96]])
                     for b in range(NUM_BLOCKS)])
    return layers, rows


def test_in_place_gathered_wire_and_store_checksums_agree():
    layers, rows = _cache()
    want = [block_checksum(row, pieces_of(PIECES)) for row in rows]
    assert block_checksums(layers, REGIONS, list(range(NUM_BLOCKS))) == want
    assert row_checksums(rows, REGIONS) == want
    chunks = list(iter_chunks(list(range(NUM_BLOCKS)), rows, [b""] * NUM_BLOCKS, 512, pieces_of(PIECES)))
    assert [c for chunk in chunks for c in chunk.run_checksums] == want
    placed = _Placed()
    store = TieredBlockStore([host_tier(NUM_BLOCKS * BLOCK_NBYTES, BLOCK_NBYTES)], BLOCK_NBYTES, placed,
                             piece_nbytes=pieces_of(PIECES))
    store.put_many([BlockKey(bytes([b]) * 16, b"\0" * 16, (b,)) for b in range(NUM_BLOCKS)], rows)
    assert placed.checksums == want   # what the store keeps, checks on reads and publishes to the index


class _Placed:
    def __init__(self) -> None:
        self.checksums: list[int] = []

    def on_events(self, events) -> None:
        self.checksums += [event.checksum for event in events if isinstance(event, BlockPlaced)]


def test_a_part_of_a_block_is_checksummed_over_its_own_pieces():
    _, rows = _cache()
    second_layer = rows[:, 128:]
    assert block_checksum(second_layer[0], pieces_of(PIECES, range(1, 2))) == block_checksum(second_layer[0], [96])


def test_a_wire_block_of_another_layout_or_a_flipped_bit_is_refused():
    _, rows = _cache()
    chunks = list(iter_chunks([0, 1], rows[:2], [b"", b""], 512, pieces_of(PIECES)))
    assert len(BlockAssembler(BLOCK_NBYTES, piece_nbytes=pieces_of(PIECES)).add(chunks[0])) == 2
    with pytest.raises(ChecksumMismatch):   # the same bytes, read as one piece: not the sender's checksum
        BlockAssembler(BLOCK_NBYTES).add(chunks[0])
    flipped = chunks[0].__class__()
    flipped.CopyFrom(chunks[0])
    flipped.data = bytes([flipped.data[0] ^ 1]) + flipped.data[1:]
    with pytest.raises(ChecksumMismatch):
        BlockAssembler(BLOCK_NBYTES, piece_nbytes=pieces_of(PIECES)).add(flipped)
    with pytest.raises(ChecksumMismatch):   # pieces that do not add up to the block
        BlockAssembler(BLOCK_NBYTES, piece_nbytes=[100]).add(chunks[0])

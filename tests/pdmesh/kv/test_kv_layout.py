"""Block addressing and copy plans of the registered-memory transports."""

import numpy as np
import xxhash

from pdmesh.kv.kv_layout import (Copy, LayerRegion, block_checksums, contiguous_runs, copy_plan, row_checksums,
                                 slab_regions)


def _region(num_blocks: int, num_parts: int = 1, part_nbytes: int = 8) -> LayerRegion:
    return LayerRegion(base=0, nbytes=num_parts * num_blocks * part_nbytes, block_stride=part_nbytes,
                       part_stride=num_blocks * part_nbytes, num_parts=num_parts, part_nbytes=part_nbytes)


def test_runs_break_where_either_side_stops_counting_up():
    assert list(contiguous_runs([4, 5, 6, 9, 10], [0, 1, 7, 8, 9])) == [(4, 0, 2), (6, 7, 1), (9, 8, 2)]
    assert list(contiguous_runs([], [])) == []


def test_a_run_of_blocks_is_one_copy_per_layer_and_part():
    src, dst = [_region(16, num_parts=2)], [_region(8, num_parts=2)]
    assert copy_plan(src, dst, [3, 4, 5], [0, 1, 2]) == [Copy(0, 24, 0, 24, first=0, part=0),
                                                                 Copy(0, 128 + 24, 64, 24, first=0, part=1)]


def test_blocks_whose_pieces_are_not_back_to_back_move_one_by_one():
    padded = LayerRegion(base=0, nbytes=256, block_stride=16, part_stride=0, num_parts=1, part_nbytes=8)
    assert copy_plan([padded], [_region(8)], [1, 2], [0, 1]) == [Copy(0, 16, 0, 8), Copy(0, 32, 8, 8, first=1)]


def test_checksums_in_place_equal_the_gathered_rows_checksums_and_hash_every_piece():
    rng = np.random.default_rng(0)
    regions = [_region(4, num_parts=2), _region(4)]
    views = [rng.integers(0, 256, r.nbytes, dtype=np.uint8) for r in regions]
    pieces = {b: [views[0][b * 8:b * 8 + 8], views[0][32 + b * 8:32 + b * 8 + 8], views[1][b * 8:b * 8 + 8]]
              for b in (2, 0)}
    want = [xxhash.xxh3_64_intdigest(b"".join(xxhash.xxh3_64_digest(p)[::-1] for p in pieces[b])) for b in (2, 0)]
    assert block_checksums(views, regions, [2, 0]) == want
    assert row_checksums(np.stack([np.concatenate(pieces[b]) for b in (2, 0)]), regions) == want
    views[0][32 + 2 * 8 + 3] ^= 1  # one bit of block 2's second piece
    flipped = block_checksums(views, regions, [2, 0])
    assert flipped[0] != want[0] and flipped[1] == want[1]


def test_a_store_export_slab_reads_like_a_cache_with_runs_of_slots_as_one_copy():
    """A KV store's export slab: layer after layer, part after part, slot after slot; blocks copied
    out of it land where a cache keeps them, and consecutive slots move as one copy per piece."""
    rng = np.random.default_rng(1)
    cache = [_region(4, num_parts=2), _region(4)]
    regions = slab_regions(0, 3, [(2, 8), (1, 8)])
    assert [(r.base, r.nbytes, r.block_stride, r.part_stride) for r in regions] == [(0, 48, 8, 24), (48, 24, 8, 24)]
    slab = rng.integers(0, 256, 72, dtype=np.uint8)
    views = [np.zeros(r.nbytes, dtype=np.uint8) for r in cache]
    for copy in copy_plan(regions, cache, [2, 0], [1, 3]):
        views[copy.layer][copy.dst:copy.dst + copy.nbytes] = slab[regions[copy.layer].base + copy.src:][:copy.nbytes]
    slab_views = [slab[r.base:r.base + r.nbytes] for r in regions]
    assert block_checksums(views, cache, [1, 3]) == block_checksums(slab_views, regions, [2, 0])
    assert len(copy_plan(regions, cache, [0, 1], [1, 2])) == 3  # one per layer and part

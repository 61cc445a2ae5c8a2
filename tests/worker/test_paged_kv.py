import pytest
import torch

from pdmesh.errors import InvalidRequest
from worker.paged_kv import PagedKVCache

NUM_BLOCKS = 6


def _caches(split_kv: bool) -> dict[str, torch.Tensor]:
    shape = (2, NUM_BLOCKS, 2, 32, 64) if split_kv else (NUM_BLOCKS, 2, 32, 128)
    return {f"layer.{i}": torch.randn(shape) for i in range(3)}


@pytest.mark.parametrize("split_kv", [False, True])
def test_block_bytes_move_between_caches_exactly(split_kv):
    src, dst = _caches(split_kv), {k: torch.zeros_like(v) for k, v in _caches(split_kv).items()}
    src_cache, dst_cache = PagedKVCache(src, NUM_BLOCKS), PagedKVCache(dst, NUM_BLOCKS)
    assert src_cache.block_nbytes == 3 * 2 * 32 * 128 * 4
    dst_cache.write_block(4, src_cache.read_block(1))
    block_dim = 1 if split_kv else 0
    for name in src:
        assert torch.equal(dst[name].select(block_dim, 4), src[name].select(block_dim, 1))
        untouched = [b for b in range(NUM_BLOCKS) if b != 4]
        assert torch.count_nonzero(dst[name].index_select(block_dim, torch.tensor(untouched))) == 0


def test_layout_names_dtype_block_dim_and_a_blocks_shape_whatever_the_number_of_blocks():
    cache = PagedKVCache(_caches(False), NUM_BLOCKS)
    assert (cache.dtype, cache.num_layers, cache.heads_outer) == ("float32", 3, False)
    assert cache.layout == "block_dim=0;block=(2, 32, 128);device=cpu"
    bigger = PagedKVCache({"layer.0": torch.zeros(2 * NUM_BLOCKS, 2, 32, 128)}, 2 * NUM_BLOCKS)
    assert bigger.layout == cache.layout  # a decode with more KV memory reads the same blocks


@pytest.mark.parametrize("split_kv", [False, True])
def test_head_major_blocks_take_a_producer_ranks_share_of_the_heads(split_kv):
    """(blocks, heads, block_size, 2 * head_size) as the CPU backend keeps it, or HND K/V apart:
    heads are named in the layout (ranks hold shares), and rank j's rows fill head range j."""
    caches = _caches(split_kv)
    cache = PagedKVCache(caches, NUM_BLOCKS, num_kv_heads=2, block_size=32)
    assert cache.heads_outer
    assert cache.layout == ("block_dim=1;block=(2, 'heads', 32, 64);device=cpu" if split_kv
                            else "block_dim=0;block=('heads', 32, 128);device=cpu")
    shares = {name: t.narrow(2 if split_kv else 1, 1, 1).clone() for name, t in caches.items()}  # head 1 of each
    rank = PagedKVCache(shares, NUM_BLOCKS, num_kv_heads=1, block_size=32)
    rows = rank.read_blocks([3])
    assert rows.shape == (1, cache.block_nbytes // 2)
    before = {name: t.clone() for name, t in caches.items()}
    cache.write_blocks([0], rows, head_slice=(1, 2))
    block_dim = 1 if split_kv else 0
    for name, t in caches.items():
        head_dim = block_dim + 1
        assert torch.equal(t.select(block_dim, 0).narrow(head_dim - 1, 1, 1),
                           before[name].select(block_dim, 3).narrow(head_dim - 1, 1, 1))
        assert torch.equal(t.select(block_dim, 0).narrow(head_dim - 1, 0, 1),
                           before[name].select(block_dim, 0).narrow(head_dim - 1, 0, 1))  # head 0 untouched
    with pytest.raises(InvalidRequest, match="not head-major"):
        PagedKVCache(_caches(split_kv), NUM_BLOCKS).write_blocks([0], rows, head_slice=(1, 2))


def test_bad_block_id_and_bad_payload_size_are_rejected():
    cache = PagedKVCache(_caches(False), NUM_BLOCKS)
    with pytest.raises(InvalidRequest, match=r"block id 6 outside \[0, 6\)"):
        cache.read_block(6)
    with pytest.raises(InvalidRequest, match="block payload 10 bytes"):
        cache.write_block(0, b"x" * 10)


def test_tensor_without_a_num_blocks_dimension_is_refused():
    with pytest.raises(ValueError, match="no dimension"):
        PagedKVCache({"l": torch.zeros(3, 4, 5)}, NUM_BLOCKS)


@pytest.mark.parametrize("split_kv", [False, True])
def test_batched_read_equals_block_by_block_reads(split_kv):
    cache = PagedKVCache(_caches(split_kv), NUM_BLOCKS)
    block_ids = [5, 0, 3]
    rows = cache.read_blocks(block_ids)
    assert rows.shape == (3, cache.block_nbytes) and rows.dtype == torch.uint8
    for row, block_id in zip(rows, block_ids):
        assert bytes(row.numpy()) == bytes(cache.read_block(block_id))
    assert cache.read_blocks([]).shape == (0, cache.block_nbytes)
    with pytest.raises(InvalidRequest, match=r"block id 6 outside"):
        cache.read_blocks([1, 6])


@pytest.mark.parametrize("split_kv", [False, True])
def test_batched_write_scatters_rows_into_their_blocks_only(split_kv):
    src, dst = _caches(split_kv), {k: torch.zeros_like(v) for k, v in _caches(split_kv).items()}
    src_cache, dst_cache = PagedKVCache(src, NUM_BLOCKS), PagedKVCache(dst, NUM_BLOCKS)
    dst_cache.write_blocks([4, 0], src_cache.read_blocks([1, 5]))
    block_dim = 1 if split_kv else 0
    for name in src:
        assert torch.equal(dst[name].select(block_dim, 4), src[name].select(block_dim, 1))
        assert torch.equal(dst[name].select(block_dim, 0), src[name].select(block_dim, 5))
        untouched = torch.tensor([1, 2, 3, 5])
        assert torch.count_nonzero(dst[name].index_select(block_dim, untouched)) == 0
    with pytest.raises(InvalidRequest, match=r"block rows of shape \(2, 3\)"):
        dst_cache.write_blocks([0, 1], torch.zeros((2, 3), dtype=torch.uint8))


@pytest.mark.parametrize("split_kv", [False, True])
def test_bytes_joined_from_the_cache_and_in_place_checksums_match_the_gathered_rows(split_kv):
    from pdmesh.kv.kv_layout import row_checksums

    cache = PagedKVCache(_caches(split_kv), NUM_BLOCKS)
    rows = cache.read_blocks([3, 0, 5]).numpy()
    assert cache.in_place
    assert cache.read_bytes([3, 0, 5]) == rows.tobytes()
    assert cache.block_checksums([3, 0, 5]) == row_checksums(rows, cache.regions())


def test_sharing_the_cache_keeps_its_bytes_and_every_view_of_it_follows(tmp_path):
    import numpy as np

    caches = _caches(split_kv=True)
    before = {name: t.clone() for name, t in caches.items()}
    views = {name: t[1] for name, t in caches.items()}  # what vLLM's layers might hold
    cache = PagedKVCache(caches, NUM_BLOCKS)
    regions = cache.share_memory()
    for (name, tensor), region in zip(caches.items(), regions):
        assert torch.equal(tensor, before[name])
        tensor[1, 2].fill_(7.0)
        assert views[name][2].eq(7.0).all()  # the view sees writes to the shared storage
        mapped = np.memmap(region.shm_path, dtype=np.uint8, mode="r", offset=region.base, shape=(region.nbytes,))
        offset = region.offset(2, 1)
        assert (mapped[offset:offset + region.part_nbytes].view(np.float32) == 7.0).all()

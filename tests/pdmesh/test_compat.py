import pytest

from pdmesh.compat import check_compatible, check_readable, model_fingerprint, tp_ratio
from pdmesh.errors import Incompatible
from pdmesh.v1 import common_pb2


def test_fingerprint_changes_with_config_dtype_and_block_size(tmp_path):
    (tmp_path / "config.json").write_text('{"hidden_size": 256}')
    base = model_fingerprint(tmp_path, "float32", 32)
    assert base == model_fingerprint(tmp_path, "float32", 32)
    assert base != model_fingerprint(tmp_path, "bfloat16", 32)
    assert base != model_fingerprint(tmp_path, "float32", 64)
    (tmp_path / "config.json").write_text('{"hidden_size": 512}')
    assert base != model_fingerprint(tmp_path, "float32", 32)


def test_check_compatible_names_each_differing_field():
    a = common_pb2.CompatInfo(model_fingerprint="x", dtype="float32", block_size=32, num_layers=4)
    check_compatible(a, a)
    b = common_pb2.CompatInfo(model_fingerprint="y", dtype="float32", block_size=32, num_layers=2)
    with pytest.raises(Incompatible, match=r"model_fingerprint: local='x' peer='y'; num_layers: local=4 peer=2$"):
        check_compatible(a, b)


def _rank(tp_size: int, num_kv_heads: int, heads_outer: bool = True) -> common_pb2.CompatInfo:
    return common_pb2.CompatInfo(model_fingerprint="fp", dtype="float32", block_size=32, num_layers=4,
                                 layout="block_dim=0;block=('heads', 32, 128);device=cpu", tp_size=tp_size,
                                 num_kv_heads=num_kv_heads, block_nbytes=num_kv_heads * 1000,
                                 heads_outer=heads_outer)


def test_a_consumer_with_fewer_ranks_reads_head_major_shares_and_nothing_else():
    check_readable(_rank(2, 1), _rank(1, 2))
    check_readable(_rank(4, 2), _rank(2, 4))
    check_readable(_rank(2, 1), _rank(2, 1))
    with pytest.raises(Incompatible, match="tp_size"):
        check_compatible(_rank(2, 1), _rank(1, 2))  # the KV store's peers: same ranks only
    with pytest.raises(Incompatible, match="tensor parallel"):
        check_readable(_rank(1, 2), _rank(2, 1))  # a consumer with more ranks
    with pytest.raises(Incompatible, match="tensor parallel"):
        check_readable(_rank(2, 1, heads_outer=False), _rank(1, 2, heads_outer=False))
    with pytest.raises(Incompatible, match="tensor parallel"):
        check_readable(_rank(2, 1), _rank(1, 4))  # heads that do not add up
    with pytest.raises(Incompatible, match="prefill needs a multiple"):
        tp_ratio(3, 2)
    assert (tp_ratio(4, 2), tp_ratio(0, 1)) == (2, 1)

import pytest

from pdmesh.compat import check_compatible, model_fingerprint
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

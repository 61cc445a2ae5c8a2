import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdmesh import weights_digest as digest_module
from pdmesh.compat import model_fingerprint
from pdmesh.weights_digest import CACHE_NAME, weights_digest


def _fine_tune(base, target, tensor_name: str):
    """A copy of a model folder with one weight nudged: same config, file names and sizes."""
    shutil.copytree(base, target, ignore=shutil.ignore_patterns(CACHE_NAME))
    weights = load_file(target / "model.safetensors")
    weights[tensor_name] = weights[tensor_name] + 1e-3
    save_file(weights, target / "model.safetensors")
    return target


@pytest.fixture
def model_copy(tiny_llama_dir, tmp_path):
    return _fine_tune(tiny_llama_dir, tmp_path / "base", "lm_head.weight")


def test_two_fine_tunes_of_one_base_model_have_different_fingerprints(model_copy, tmp_path):
    name = next(iter(load_file(model_copy / "model.safetensors")))
    tuned = _fine_tune(model_copy, tmp_path / "tuned", name)
    assert (tuned / "model.safetensors").stat().st_size == (model_copy / "model.safetensors").stat().st_size
    assert (tuned / "config.json").read_bytes() == (model_copy / "config.json").read_bytes()
    assert model_fingerprint(tuned, "float32", 32) != model_fingerprint(model_copy, "float32", 32)
    twin = tmp_path / "twin"
    shutil.copytree(model_copy, twin, ignore=shutil.ignore_patterns(CACHE_NAME))  # the same weights elsewhere
    assert model_fingerprint(twin, "float32", 32) == model_fingerprint(model_copy, "float32", 32)


def test_a_safetensors_header_change_alone_changes_the_digest(tmp_path):
    save_file({"a": torch.zeros(4, 2)}, tmp_path / "model.safetensors")
    before = weights_digest(tmp_path)
    save_file({"a": torch.zeros(2, 4)}, tmp_path / "model.safetensors")  # same bytes of data, other shape
    assert weights_digest(tmp_path) != before


def test_the_content_digest_is_cached_beside_the_weights_until_the_file_changes(model_copy, monkeypatch):
    first = weights_digest(model_copy)
    cache = json.loads((model_copy / CACHE_NAME).read_text())
    assert set(cache) == {"model.safetensors"}
    hashed = []
    real = digest_module.content_digest
    monkeypatch.setattr(digest_module, "content_digest", lambda path: hashed.append(path.name) or real(path))
    assert weights_digest(model_copy) == first
    assert hashed == []
    weights_file = model_copy / "model.safetensors"
    data = bytearray(weights_file.read_bytes())
    data[-1] ^= 0x01  # one bit of the last tensor, in place: size unchanged
    weights_file.write_bytes(bytes(data))
    assert weights_digest(model_copy) != first
    assert hashed == ["model.safetensors"]


def test_a_stale_cache_entry_is_not_trusted(model_copy):
    first = weights_digest(model_copy)
    cache_file = model_copy / CACHE_NAME
    cache = json.loads(cache_file.read_text())
    cache["model.safetensors"]["digest"] = "0" * 32
    cache["model.safetensors"]["mtime_ns"] -= 1   # written for an older version of the file
    cache_file.write_text(json.dumps(cache))
    assert weights_digest(model_copy) == first
    cache_file.write_text("{not json")
    assert weights_digest(model_copy) == first


def test_a_read_only_model_folder_caches_under_the_users_cache(model_copy, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    writable = os.access
    monkeypatch.setattr(digest_module.os, "access", lambda path, mode: path != model_copy and writable(path, mode))
    first = weights_digest(model_copy)
    assert not (model_copy / CACHE_NAME).exists()
    assert len(list((tmp_path / "cache" / "pdmesh" / "weights-digest").glob("*.json"))) == 1
    assert weights_digest(model_copy) == first

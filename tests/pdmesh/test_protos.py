import filecmp
import subprocess
import sys
from pathlib import Path

from pdmesh.v1 import common_pb2, generate_pb2, kv_transfer_pb2

ROOT = Path(__file__).resolve().parents[2]


def test_generate_request_round_trips():
    request = generate_pb2.GenerateRequest(
        request_id="r-1", model="tiny-llama", token_ids=generate_pb2.TokenIds(ids=[0, 5, 1023]),
        sampling=common_pb2.SamplingParams(max_tokens=8, temperature=0.5, top_p=0.9, seed=7, stop=["\n"]))
    parsed = generate_pb2.GenerateRequest.FromString(request.SerializeToString())
    assert parsed == request
    assert parsed.WhichOneof("prompt") == "token_ids"
    assert list(parsed.token_ids.ids) == [0, 5, 1023]
    assert parsed.sampling.HasField("seed") and parsed.sampling.seed == 7


def test_unset_seed_is_distinguishable_from_zero():
    parsed = common_pb2.SamplingParams.FromString(common_pb2.SamplingParams(max_tokens=1).SerializeToString())
    assert not parsed.HasField("seed")


def test_kv_chunk_and_handle_round_trip():
    chunk = kv_transfer_pb2.KVChunk(block_index=2, offset=1 << 20, data=b"\x00\xff" * 10, block_nbytes=3 << 20,
                                    last=True, checksum=(1 << 64) - 1, block_hash=b"\x01" * 16)
    assert kv_transfer_pb2.KVChunk.FromString(chunk.SerializeToString()) == chunk
    handle = common_pb2.KVHandle(transfer_id="t", kv_address="127.0.0.1:1", block_ids=[4, 9], num_tokens=40,
                                 compat=common_pb2.CompatInfo(model_fingerprint="ab", block_size=32))
    assert common_pb2.KVHandle.FromString(handle.SerializeToString()) == handle


def test_generated_code_matches_protos(tmp_path):
    protos = ROOT / "protos"
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{protos}", f"--python_out={tmp_path}",
                    f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}",
                    *sorted(str(p) for p in (protos / "pdmesh" / "v1").glob("*.proto"))], check=True)
    generated = sorted(p.name for p in (tmp_path / "pdmesh" / "v1").iterdir())
    committed = sorted(p.name for p in (ROOT / "pdmesh" / "v1").glob("*_pb2*"))
    assert generated == committed
    match, mismatch, errors = filecmp.cmpfiles(tmp_path / "pdmesh" / "v1", ROOT / "pdmesh" / "v1", generated,
                                               shallow=False)
    assert (mismatch, errors) == ([], []), "run scripts/gen_protos.sh"

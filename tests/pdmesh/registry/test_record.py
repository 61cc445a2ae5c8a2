"""A registry record is the WorkerRecord proto's JSON: round trip, a newer worker's extra fields, and
every malformed value a ValueError."""

from __future__ import annotations

import json

import pytest

from pdmesh.registry import WorkerRecord, decode_record, encode_record


def _record(**overrides) -> WorkerRecord:
    fields = dict(role="prefill", address="10.0.0.1:50051", kv_address="10.0.0.1:7000", model="tiny-llama",
                  model_fingerprint="fp-1234", max_num_seqs=64, num_kv_blocks=512, num_running=3, num_waiting=2,
                  kv_cache_usage=0.25, started_at=1_700_000_000.5, updated_at=1_700_000_001.0,
                  prefill_tokens_per_s=2500.0, decode_step_s=0.02)
    return WorkerRecord(**(fields | overrides))


def test_a_record_round_trips_and_reads_as_plain_json():
    text = encode_record(_record())
    assert decode_record(text) == _record()
    assert json.loads(text) == {"role": "prefill", "address": "10.0.0.1:50051", "kv_address": "10.0.0.1:7000",
                                "model": "tiny-llama", "model_fingerprint": "fp-1234", "max_num_seqs": 64,
                                "num_kv_blocks": 512, "num_running": 3, "num_waiting": 2, "kv_cache_usage": 0.25,
                                "started_at": 1_700_000_000.5, "updated_at": 1_700_000_001.0,
                                "prefill_tokens_per_s": 2500.0, "decode_step_s": 0.02}


def test_fields_a_newer_worker_adds_are_ignored_and_a_zero_load_is_written_out():
    newer = json.loads(encode_record(_record())) | {"zone": "eu-west-1", "gpu": {"kind": "H200"}}
    assert decode_record(json.dumps(newer)) == _record()
    idle = json.loads(encode_record(_record(num_running=0, kv_cache_usage=0.0)))
    assert (idle["num_running"], idle["kv_cache_usage"]) == (0, 0.0)


def test_a_worker_taking_both_roles_is_listed_with_its_kv_server():
    assert decode_record(encode_record(_record(role="both"))) == _record(role="both")


@pytest.mark.parametrize("text", [
    "{not json", "[1, 2]", "\"a string\"", b"\xff\xfe",
    json.dumps({"role": "prefill"}),                                                    # no address
    json.dumps({"role": "prefill", "address": "a:1"}),                                  # a prefill without KV server
    json.dumps({"role": "both", "address": "a:1"}),                                     # so is a worker taking both
    encode_record(_record()).replace('"max_num_seqs": 64', '"max_num_seqs": "many"'),   # wrong type
    encode_record(_record()).replace('"max_num_seqs": 64', '"max_num_seqs": true'),     # bool is no int
    encode_record(_record()).replace('"max_num_seqs": 64', '"max_num_seqs": 1.5'),
    encode_record(_record()).replace('"role": "prefill"', '"role": "router"'),          # unknown role
    encode_record(_record()).replace('"kv_cache_usage": 0.25', '"kv_cache_usage": "NaN"'),   # poisons routing
    encode_record(_record()).replace('"kv_cache_usage": 0.25', '"kv_cache_usage": 1.5'),
])
def test_a_malformed_record_raises_value_error(text):
    with pytest.raises(ValueError):
        decode_record(text)

"""A worker's registry record: the `pdmesh.v1.WorkerRecord` proto, stored as its JSON (readable with
redis-cli; fields a newer worker adds are ignored by an older gateway)."""

from __future__ import annotations

from google.protobuf import json_format

from pdmesh.v1.worker_pb2 import WorkerRecord

ROLES = ("prefill", "decode")


def encode_record(record: WorkerRecord) -> str:
    return json_format.MessageToJson(record, preserving_proto_field_name=True, indent=None, sort_keys=True,
                                     always_print_fields_with_no_presence=True)


def decode_record(text: str | bytes) -> WorkerRecord:
    """Parses and checks a stored record. Raises ValueError when malformed."""
    try:
        record = json_format.Parse(text, WorkerRecord(), ignore_unknown_fields=True)
    except (json_format.ParseError, UnicodeDecodeError) as exc:
        raise ValueError(str(exc)) from exc
    if record.role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, not {record.role!r}")
    if not record.address:
        raise ValueError("no address")
    if record.role == "prefill" and not record.kv_address:
        raise ValueError("a prefill record without its kv_address")
    if not 0.0 <= record.kv_cache_usage <= 1.0:  # NaN too: it would poison the routing cost
        raise ValueError(f"kv_cache_usage {record.kv_cache_usage} outside 0..1")
    return record

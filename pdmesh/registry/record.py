"""A worker's registry record: the `pdmesh.v1.WorkerRecord` proto, stored as its JSON (readable with
redis-cli; fields a newer worker adds are ignored by an older gateway). With a mesh token the JSON
also holds a `signature` of the record and the key it is stored under (pdmesh/mesh_signing.py)."""

from __future__ import annotations

import json

from google.protobuf import json_format

from pdmesh.mesh_signing import EntrySigner
from pdmesh.registry.keys import record_key
from pdmesh.v1.worker_pb2 import WorkerRecord

ROLES = ("prefill", "decode", "both")   # both: a worker taking either role per request (python -m node)
SIGNATURE_FIELD = "signature"


class UntrustedRecord(Exception):
    """A well-formed record the registry must not believe: its signature is missing or wrong, or it
    is stored under a key that is not its own (another worker's address or role)."""


def encode_record(record: WorkerRecord) -> str:
    return json_format.MessageToJson(record, preserving_proto_field_name=True, indent=None, sort_keys=True,
                                     always_print_fields_with_no_presence=True)


def seal_record(record: WorkerRecord, key: str, signer: EntrySigner | None) -> str:
    """The value stored under `key`: the record's JSON, signed with the key when there is a signer."""
    text = encode_record(record)
    if signer is None:
        return text
    fields = json.loads(text)
    return json.dumps(fields | {SIGNATURE_FIELD: signer.sign(key, fields)}, sort_keys=True)


def open_record(prefix: str, key: str, value: str | bytes, signer: EntrySigner | None) -> WorkerRecord:
    """The record stored under `key`, checked. Raises ValueError when malformed, UntrustedRecord when
    unsigned or wrongly signed (with a signer) or stored under a key other than its own."""
    record = decode_record(value) if signer is None else _decode_signed(key, value, signer)
    if key != record_key(prefix, record.role, record.address):
        raise UntrustedRecord(f"a record of {record.role} {record.address} stored under another key")
    return record


def decode_record(text: str | bytes) -> WorkerRecord:
    """Parses and checks a stored record. Raises ValueError when malformed."""
    try:
        record = json_format.Parse(text, WorkerRecord(), ignore_unknown_fields=True)
    except (json_format.ParseError, UnicodeDecodeError) as exc:
        raise ValueError(str(exc)) from exc
    return _checked(record)


def _decode_signed(key: str, value: str | bytes, signer: EntrySigner) -> WorkerRecord:
    """The record is read from the very fields the signature covers."""
    fields = json.loads(value)   # ValueError when not JSON
    if not isinstance(fields, dict):
        raise ValueError("a record is a JSON object")
    signature = fields.pop(SIGNATURE_FIELD, None)
    if not signer.verify(key, fields, signature if isinstance(signature, str) else None):
        raise UntrustedRecord("missing or wrong signature")
    try:
        record = json_format.ParseDict(fields, WorkerRecord(), ignore_unknown_fields=True)
    except json_format.ParseError as exc:
        raise ValueError(str(exc)) from exc
    return _checked(record)


def _checked(record: WorkerRecord) -> WorkerRecord:
    if record.role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, not {record.role!r}")
    if not record.address:
        raise ValueError("no address")
    if record.role in ("prefill", "both") and not record.kv_address:
        raise ValueError(f"a {record.role} record without its kv_address")
    if not 0.0 <= record.kv_cache_usage <= 1.0:  # NaN too: it would poison the routing cost
        raise ValueError(f"kv_cache_usage {record.kv_cache_usage} outside 0..1")
    return record

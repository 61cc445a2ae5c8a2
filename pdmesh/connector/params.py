"""The kv_transfer_params dicts the connector exchanges through vLLM, and their proto form.

Prefill requests carry {"do_remote_decode": True, ...}; the engine answers with the
KVHandle fields; decode requests carry {"do_remote_prefill": True, <KVHandle fields>}.
No torch or vLLM imports: the workers' servicers use this module too.
"""

from __future__ import annotations

from typing import Any

from pdmesh.v1 import common_pb2

DO_REMOTE_DECODE = "do_remote_decode"
DO_REMOTE_PREFILL = "do_remote_prefill"
PDMESH_REQUEST_ID = "pdmesh_request_id"
TRACE_CARRIER = "pdmesh_trace"  # W3C traceparent + baggage of the calling span, for the engine-side spans
LOADED_FROM_STORE = "pdmesh_loaded_from_store"  # prefill handle: some prompt blocks came from the KV store
# In a finished request's kv_transfer_params: what its KV pull (decode) or store load (prefill) did,
# the fields of TransferStats / StoreLoadStats. Rides the engine's own output: no RPC per request.
REQUEST_STATS = "pdmesh_stats"


def prefill_params(request_id: str, trace_carrier: dict[str, str] | None = None) -> dict[str, Any]:
    return {DO_REMOTE_DECODE: True, PDMESH_REQUEST_ID: request_id, TRACE_CARRIER: dict(trace_carrier or {})}


def decode_params(request_id: str, handle: common_pb2.KVHandle | None,
                  trace_carrier: dict[str, str] | None = None) -> dict[str, Any]:
    """A decode request's params: pull `handle`'s KV; with no handle, compute the prompt here."""
    if handle is None or not handle.transfer_id:
        return {PDMESH_REQUEST_ID: request_id, TRACE_CARRIER: dict(trace_carrier or {})}
    return {
        DO_REMOTE_PREFILL: True,
        PDMESH_REQUEST_ID: request_id,
        TRACE_CARRIER: dict(trace_carrier or {}),
        "transfer_id": handle.transfer_id,
        "kv_address": handle.kv_address,
        "block_ids": list(handle.block_ids),
        "num_tokens": handle.num_tokens,
    }


def handle_params(transfer_id: str, kv_address: str, block_ids: list[int], num_tokens: int) -> dict[str, Any]:
    """What the producer's request_finished returns; surfaces as RequestOutput.kv_transfer_params."""
    return {"transfer_id": transfer_id, "kv_address": kv_address,
            "block_ids": list(block_ids), "num_tokens": num_tokens}


def handle_from_params(params: dict[str, Any], compat: common_pb2.CompatInfo) -> common_pb2.KVHandle:
    return common_pb2.KVHandle(
        transfer_id=params["transfer_id"],
        kv_address=params["kv_address"],
        block_ids=params["block_ids"],
        num_tokens=params["num_tokens"],
        compat=compat,
    )

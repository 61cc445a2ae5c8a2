"""The kv_transfer_params dicts the connector exchanges through vLLM, and their proto form.

Prefill requests carry {"do_remote_decode": True, ...}; the engine answers with
{KV_HANDLE: <KVHandle fields>}; decode requests carry {"do_remote_prefill": True, KV_HANDLE: ...}.
No torch or vLLM imports: the workers' servicers use this module too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdmesh.v1 import common_pb2

DO_REMOTE_DECODE = "do_remote_decode"
DO_REMOTE_PREFILL = "do_remote_prefill"
PDMESH_REQUEST_ID = "pdmesh_request_id"
TRACE_CARRIER = "pdmesh_trace"  # W3C traceparent + baggage of the calling span, for the engine-side spans
LOADED_FROM_STORE = "pdmesh_loaded_from_store"  # prefill handle: some prompt blocks came from the KV store
# In a finished request's kv_transfer_params: what its KV pull (decode) or store load (prefill) did,
# PullStats / StoreLoadStats encoded (pdmesh/kv/request_stats.py). Rides the engine's own output: no RPC per request.
REQUEST_STATS = "pdmesh_stats"
KV_HANDLE = "pdmesh_kv"  # the KVHandle's fields
# In every finished request's kv_transfer_params: its engine's measured prompt rate, tokens/s
# (worker/compute_rate.py); the servicers pass it to the gateway in their answers.
PREFILL_TOKENS_PER_S = "pdmesh_prefill_tokens_per_s"
# Beside it: the engine's decoding step time, seconds (worker/step_time.py: the TPOT its streams see; 0: unknown).
DECODE_STEP_S = "pdmesh_decode_step_s"
# Prefill request, layer-wise flow: the transfer id (minted by the gateway, also given to decode)
# its KV is published under while it is computed.
LAYERWISE_TRANSFER_ID = "pdmesh_layerwise_transfer_id"


def prefill_params(request_id: str, trace_carrier: dict[str, str] | None = None,
                   layerwise_transfer_id: str = "") -> dict[str, Any]:
    params = {DO_REMOTE_DECODE: True, PDMESH_REQUEST_ID: request_id, TRACE_CARRIER: dict(trace_carrier or {})}
    return {**params, LAYERWISE_TRANSFER_ID: layerwise_transfer_id} if layerwise_transfer_id else params


@dataclass(frozen=True)
class KVHandle:
    """Where a request's KV lives after prefill: the one typed form of the handle. It travels in
    kv_transfer_params under KV_HANDLE (the dict vLLM carries) and as pdmesh.v1.KVHandle on the wire.
    `transfer_id` is minted by the prefill worker and unguessable: it is the capability to read or
    free the blocks on `kv_address`, the producer's KV port (which transport moves them is agreed
    per peer at handshake, decode/kv/kv_links.py)."""

    transfer_id: str
    kv_address: str
    block_ids: tuple[int, ...]   # the producer's block ids, in token order
    num_tokens: int              # prompt tokens the blocks hold
    tp_size: int = 1             # the producer's tensor-parallel ranks: rank r serves on kv_address's port + r
    layerwise: bool = False      # still prefilling: block_ids is empty, each layer is read as it is written

    def to_params(self) -> dict[str, Any]:
        return {"transfer_id": self.transfer_id, "kv_address": self.kv_address,
                "block_ids": list(self.block_ids), "num_tokens": self.num_tokens, "tp_size": self.tp_size,
                "layerwise": self.layerwise}

    @classmethod
    def from_params(cls, params: dict[str, Any]) -> "KVHandle":
        fields = params[KV_HANDLE]
        return cls(str(fields["transfer_id"]), str(fields["kv_address"]), tuple(int(b) for b in fields["block_ids"]),
                   int(fields["num_tokens"]), max(1, int(fields.get("tp_size", 1))), bool(fields.get("layerwise")))

    def to_proto(self, compat: common_pb2.CompatInfo) -> common_pb2.KVHandle:
        return common_pb2.KVHandle(transfer_id=self.transfer_id, kv_address=self.kv_address,
                                   block_ids=self.block_ids, num_tokens=self.num_tokens, compat=compat,
                                   tp_size=self.tp_size, layerwise=self.layerwise)

    @classmethod
    def from_proto(cls, message: common_pb2.KVHandle) -> "KVHandle":
        return cls(message.transfer_id, message.kv_address, tuple(message.block_ids), message.num_tokens,
                   max(1, message.tp_size), message.layerwise)


def decode_params(request_id: str, handle: common_pb2.KVHandle | None,
                  trace_carrier: dict[str, str] | None = None) -> dict[str, Any]:
    """A decode request's params: pull `handle`'s KV; with no handle, compute the prompt here."""
    params = {PDMESH_REQUEST_ID: request_id, TRACE_CARRIER: dict(trace_carrier or {})}
    if handle is None or not handle.transfer_id:
        return params
    return {**params, DO_REMOTE_PREFILL: True, KV_HANDLE: KVHandle.from_proto(handle).to_params()}


def handle_params(handle: KVHandle) -> dict[str, Any]:
    """What the producer's request_finished returns; surfaces as RequestOutput.kv_transfer_params."""
    return {KV_HANDLE: handle.to_params()}


def handle_from_params(params: dict[str, Any], compat: common_pb2.CompatInfo) -> common_pb2.KVHandle:
    return KVHandle.from_params(params).to_proto(compat)

"""In-process stand-ins for prefill/decode workers (unit tests only; tests/e2e drives real ones)."""

from __future__ import annotations

import asyncio

import grpc

from decode.decode_streams import DecodeStreamsCall
from pdmesh.errors import TransferNotFound, WorkerFailed
from pdmesh.grpc_errors import maps_domain_errors
from pdmesh.grpc_server import AioServer
from pdmesh.status_map import error_from_grpc
from pdmesh.v1 import common_pb2, worker_pb2, worker_pb2_grpc

COMPAT = common_pb2.CompatInfo(model_fingerprint="fp", dtype="float32", block_size=32, layout="l",
                               num_layers=4, block_nbytes=1024)


def info(role: str, compat: common_pb2.CompatInfo = COMPAT) -> worker_pb2.WorkerInfoResponse:
    return worker_pb2.WorkerInfoResponse(role=role, model="tiny-llama", max_model_len=128, compat=compat,
                                         vocab_size=1024)


class FakeWorker(worker_pb2_grpc.WorkerInfoServicer, worker_pb2_grpc.PrefillServicer,
                 worker_pb2_grpc.DecodeServicer):
    """Prefill answers a handle; decode echoes prompt ids back as 'generated' tokens."""

    def __init__(self, role: str, compat: common_pb2.CompatInfo = COMPAT, kv_address: str = "127.0.0.1:1",
                 fail_decode: bool = False, fail_after: int | None = None, fail_prefill: bool = False) -> None:
        self.info = info(role, compat)
        self.kv_address = kv_address
        self.fail_decode = fail_decode
        self.fail_after = fail_after   # decode: streams this many tokens, then dies (UNAVAILABLE)
        self.num_calls_to_cut = 0      # decode: this many calls die after one token (a reset connection), then none
        self.fail_prefill = fail_prefill  # prefill: dies (UNAVAILABLE) after a moment
        self.num_cancelled = 0          # decode: calls the gateway cancelled while they waited for KV
        self.prefilled = asyncio.Event()  # a prefill answered: a layer-wise decode waits for one
        self.prefill_finish = common_pb2.FINISH_REASON_LENGTH  # of prefill's one-token generation
        self.requests: list = []
        self.released: list[str] = []  # prefill: transfer ids the gateway released
        # prefill: the KV it pins, transfer id -> request id, until a decode pulls it or it is released; a
        # cancelled Prefill frees what its request id holds (as the real servicer's pdmesh_release_request)
        self.held: dict[str, str] = {}
        self.released_requests: list[str] = []  # prefill: request ids a cancelled Prefill freed the KV of
        self.kv_source: FakeWorker | None = None  # decode: the prefill whose held KV a handle is pulled from
        self.decode_gate: asyncio.Event | None = None  # decode: each call waits for it before reading KV
        self.layerwise_prefill: FakeWorker | None = None  # decode: the prefill a layer-wise request waits on
        self.decode_status: tuple | None = None  # decode: fails every request with the error this status names
        self.call_status: tuple | None = None    # decode: tears every call down with this status (a reset connection)
        self.prefill_delay_s = 0.0   # prefill: answers after this long
        self.token_delay_s = 0.0     # decode: waits this long before each token
        self.finish_with_last_token = False  # decode: the last token and the finish in one message (as vLLM's)
        self.num_info_calls = 0
        self.prefill_tokens_per_s = 5000.0   # the prompt rate it publishes in its answers (a real engine measures it)
        self.server = AioServer([])
        worker_pb2_grpc.add_WorkerInfoServicer_to_server(self, self.server.server)
        if role in ("prefill", "both"):
            worker_pb2_grpc.add_PrefillServicer_to_server(self, self.server.server)
        if role in ("decode", "both"):
            worker_pb2_grpc.add_DecodeServicer_to_server(self, self.server.server)

    async def GetInfo(self, request, context):
        self.num_info_calls += 1
        return self.info

    async def Prefill(self, request, context):
        self.requests.append(request)
        if self.fail_prefill:
            await asyncio.sleep(0.2)  # decode is waiting for the KV meanwhile
            await context.abort(grpc.StatusCode.UNAVAILABLE, "prefill engine died")
        try:
            await asyncio.sleep(self.prefill_delay_s)
        except asyncio.CancelledError:
            self._release_request(request.request_id)
            raise
        self.prefilled.set()
        self.held["t-" + request.request_id] = request.request_id
        return worker_pb2.PrefillResponse(request_id=request.request_id, kv=common_pb2.KVHandle(
            transfer_id="t-" + request.request_id, kv_address=self.kv_address, block_ids=[0],
            num_tokens=len(request.prompt_token_ids), compat=self.info.compat),
            num_computed_tokens=len(request.prompt_token_ids), first_token_id=777, first_text="<777>",
            finish_reason=self.prefill_finish, prefill_tokens_per_s=self.prefill_tokens_per_s)

    async def Release(self, request, context):
        self.released.append(request.transfer_id)
        self.held.pop(request.transfer_id, None)
        return worker_pb2.ReleaseKVResponse(released=True)

    def _release_request(self, request_id: str) -> None:
        self.released_requests.append(request_id)
        for transfer_id in [t for t, held_by in self.held.items() if held_by == request_id]:
            del self.held[transfer_id]

    @maps_domain_errors
    async def Decode(self, request, context):
        if self.call_status is not None:
            self.requests.append(request)
            raise error_from_grpc(*self.call_status)
        async for chunk in self._decode(request):
            yield chunk

    async def DecodeStreams(self, request_iterator, context):
        if self.call_status is not None:   # the call dies with the first request it carries
            async for message in request_iterator:
                self.requests.append(message.open)
                await context.abort(*self.call_status)
        async for message in DecodeStreamsCall(self._decode).serve(request_iterator):
            yield message

    async def _decode(self, request):
        """Decode's messages; a failure is the domain error its status stands for (either call sends it)."""
        self.requests.append(request)
        if self.fail_decode:
            raise WorkerFailed("decode engine died")
        if self.decode_status is not None:
            raise error_from_grpc(*self.decode_status)
        if request.kv.layerwise and self.layerwise_prefill is not None:
            try:  # a real decode waits for the prompt's last layer: here, for the prefill's answer
                await self.layerwise_prefill.prefilled.wait()
            except asyncio.CancelledError:
                self.num_cancelled += 1
                raise
        if self.decode_gate is not None:
            await self.decode_gate.wait()
        if self.kv_source is not None and request.kv.transfer_id:
            self._pull(request.kv.transfer_id)
        token_ids = request.prompt_token_ids[:request.sampling.max_tokens]
        last = len(token_ids) - 1 if self.finish_with_last_token else None
        cut = self.num_calls_to_cut > 0
        self.num_calls_to_cut -= cut
        for i, token_id in enumerate(token_ids):
            if self.token_delay_s:
                await asyncio.sleep(self.token_delay_s)
            if i == self.fail_after or cut and i == 1:
                raise WorkerFailed("decode engine died mid-stream")
            if i != last:
                yield worker_pb2.DecodeResponse(token_ids=[token_id], text=f"<{token_id}>")
        finish = worker_pb2.DecodeResponse(finish_reason=common_pb2.FINISH_REASON_LENGTH,
                                           num_cached_tokens=len(request.prompt_token_ids),
                                           prefill_tokens_per_s=self.prefill_tokens_per_s)
        if last is not None:
            finish.token_ids.append(token_ids[last])
            finish.text = f"<{token_ids[last]}>"
        yield finish

    def _pull(self, transfer_id: str) -> None:
        """Reads (and frees) the KV its prefill holds; a transfer no longer held fails the call, as a real pull."""
        if self.kv_source.held.pop(transfer_id, None) is None:
            raise TransferNotFound(f"no KV held for transfer {transfer_id!r}")

"""One request's way through the mesh: prefill then decode, and again elsewhere when a worker fails.

Before the first token a failed prefill or decode is retried on another worker, invisibly. After
tokens have streamed, the request resumes on another decode worker from prompt + the tokens
already sent: a prefill worker runs that longer prompt, finding the prompt's blocks in its prefix
cache or KV store (it computes only the tail), and the new decode pulls them and continues with
the remaining max_tokens. The client sees each token exactly once. Greedy output is unchanged by
a failover; seeded sampling restarts its random stream at the resume point, and a stop string
that spans the resume point is not seen.

Whatever ends an attempt other than a finished decode (failure, cancel, deadline) releases the
prefill's pinned blocks, so a cancelled request never waits for the hold timeout.

Each attempt is placed first: the routing policy's pair and the disaggregation policy's local or
remote (gateway/disagg.py), or, adaptive, every worker and pair weighed (gateway/placement.py). It
counts the prompt tokens it has each worker computing, reports the handoff it saw, and keeps the
prompt rate each worker publishes in its answers: the placement's inputs.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing

import grpc

from gateway.decode_streams import StreamFailed, decode_call
from gateway.disagg import Decision, DisaggPolicy
from gateway.layerwise_flow import layerwise_handle, until_prefill_fails
from gateway.pool import Worker, WorkerPool
from gateway.placement import place
from gateway.prompt_names import PromptNames
from gateway.routing import RoutePolicy
from gateway.run_state import MeshRequest, RunState, response_of
from pdmesh import errors
from pdmesh.telemetry.grpc_client import client_span
from pdmesh.v1 import common_pb2, generate_pb2, worker_pb2, worker_pb2_grpc

logger = logging.getLogger(__name__)
PREFILL_METHOD = "/pdmesh.v1.Prefill/Prefill"
DECODE_METHOD = "/pdmesh.v1.Decode/Decode"
LAYERWISE_PREFILL_GRACE_S = 1.0  # layer-wise: the last message waits this long for prefill's answer

# Errors after which another worker may succeed; anything else is the request's own fault.
RETRYABLE = (errors.WorkerFailed, errors.TransferNotFound, errors.ChecksumMismatch, errors.BlockHashMismatch)
RETRYABLE_CODES = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN,
                   grpc.StatusCode.CANCELLED, grpc.StatusCode.ABORTED}


class _Move(Exception):
    """The stream was asked to move off its worker (gateway/flows.py)."""

    def __init__(self, worker: str) -> None:
        super().__init__(f"moving off {worker}")
        self.worker = worker


class _Retry(Exception):
    def __init__(self, error: errors.PDMeshError) -> None:
        super().__init__(str(error))
        self.error = error


class RequestRun:
    def __init__(self, pool: WorkerPool, policy: RoutePolicy, disagg: DisaggPolicy, request: MeshRequest,
                 deadline: float, max_attempts: int, stream_prefill_token: bool, layerwise: bool = False,
                 decode_streams: bool = True) -> None:
        self._pool = pool
        self._policy = policy
        self._disagg = disagg
        self.request = request
        self.state = RunState()
        self._deadline = deadline
        self._max_attempts = max_attempts
        self._layerwise = layerwise   # decode reads each layer while prefill computes the next
        self._stream_prefill_token = stream_prefill_token and not layerwise
        self._decode_streams = decode_streams   # decodes share each worker's one call, else a call each
        self._excluded: set[str] = set()   # workers that failed this request
        self._prefilled_at = 0.0            # monotonic time the latest remote prefill answered
        self._moving_from = ""              # the worker the next attempt's stream moves off

    async def responses(self) -> AsyncIterator[generate_pb2.GenerateResponse]:
        """What the client sees, across failovers: the tokens, and on the last message the usage and
        how the request's KV travelled."""
        async for chunk in self._chunks():
            yield response_of(self.request, self.state, chunk)

    def span_attributes(self) -> dict:
        """Where the request ran and what it took, once it ended."""
        state = self.state
        return {"pdmesh.route.prefill": state.prefill.address if state.prefill else "",
                "pdmesh.route.decode": state.decode.address if state.decode else "",
                **(state.decision.span_attributes() if state.decision else {}),
                "pdmesh.failovers": state.num_failovers, "pdmesh.moves": state.num_moves,
                "pdmesh.completion_tokens": len(state.generated)}

    async def _chunks(self) -> AsyncIterator[worker_pb2.DecodeResponse]:
        """The decode stream, across failovers and moves."""
        last_failure: errors.PDMeshError | None = None
        while self.state.num_failovers < self._max_attempts:
            try:
                async for chunk in self._attempt():
                    yield chunk
                return
            except _Move as move:
                logger.info("request %s: %s after %d tokens", self.request.request_id, move,
                            len(self.state.generated))
                self.state.num_moves += 1
                self.state.resumed_at_token = len(self.state.generated)
                self._moving_from = move.worker
            except _Retry as retry:
                logger.warning("request %s: %s; retrying elsewhere after %d tokens", self.request.request_id,
                               retry.error, len(self.state.generated))
                last_failure = retry.error
                self.state.num_failovers += 1
                self.state.resumed_at_token = len(self.state.generated)
            except errors.NoWorkerAvailable:
                if last_failure is None:
                    raise
                break   # nobody left to retry on: report what failed
        raise last_failure

    async def _attempt(self) -> AsyncIterator[worker_pb2.DecodeResponse]:
        state = self.state
        prompt = [*self.request.prompt_token_ids, *state.generated]
        num_left = self.request.sampling.max_tokens - len(state.generated)
        if num_left <= 0:  # the stream broke after the last token, before its finish
            yield worker_pb2.DecodeResponse(finish_reason=common_pb2.FINISH_REASON_LENGTH)
            return
        names = PromptNames(prompt, self.request.cache_salt)   # hashed once, for routing and the policy
        state.decode, state.prefill_seconds, state.handoff_seconds = None, 0.0, 0.0   # the latest attempt's
        adaptive = self._disagg.adaptive
        placed = (place(self._pool, self._disagg, names, self._excluded, self.request.slo,
                        self._moving_from) if adaptive
                  else self._route(names, len(prompt) + num_left))
        prefill, decode, state.decision = await placed
        self._moving_from = ""
        state.prefill = None if state.decision.local else prefill
        state.placed.append((state.decision.local, len(prompt)))
        if state.decision.local:
            chunks = self._local_chunks(decode, prompt)
        elif self._layerwise:
            chunks = self._layerwise_chunks(prefill, decode, prompt)
        else:
            chunks = self._pull_chunks(prefill, decode, prompt, num_left)
        stream = (self._disagg.flows.open(decode.address, num_left, self.request.slo.tpot_s,
                                          movable=state.num_moves == 0) if adaptive else None)
        try:
            async with aclosing(chunks):
                async for chunk in chunks:
                    state.generated += chunk.token_ids
                    yield chunk
                    if stream is not None:
                        stream.on_tokens(len(chunk.token_ids), time.monotonic())
                        if stream.move_asked and not chunk.finish_reason:
                            raise _Move(decode.address)   # closing `chunks` cancels this attempt's calls
        finally:
            if stream is not None:
                self._disagg.flows.close(stream)

    async def _pull_chunks(self, prefill: Worker, decode: Worker, prompt: list[int],
                           num_left: int) -> AsyncIterator[worker_pb2.DecodeResponse]:
        """Prefill, then decode reading its KV. An attempt that ends before decode's last message
        releases the prefill's blocks: decode may never have read them."""
        prefilled = await self._prefill(prefill, prompt)
        self.state.record_prefill(prefilled)
        finished = False
        try:
            async for chunk in self._decode_chunks(decode, prompt, num_left, prefilled):
                finished = finished or bool(chunk.finish_reason)
                yield chunk
        finally:
            if not finished:
                logger.info("request %s: attempt ended early, releasing transfer %s", self.request.request_id,
                            prefilled.kv.transfer_id)
                self._pool.release_kv_soon(prefill, prefilled.kv)

    async def _route(self, names: PromptNames, num_tokens: int) -> tuple[Worker, Worker, Decision]:
        """The routing policy's prefill, then its decode among the others, then local or remote."""
        prefill = await self._policy.pick_prefill(await self._pool.candidates("prefill", self._excluded), names)
        candidates = await self._pool.candidates("decode", self._excluded)
        if prefill.info is None:   # another request's failed call marked it down while this one waited
            self._excluded.add(prefill.address)
            raise _Retry(errors.WorkerFailed(f"prefill worker {prefill.address} went down"))
        # Pairing is checked before the prefill runs: an incompatible pair costs no compute.
        decodes = self._pool.compatible_with(prefill, candidates)
        others = [d for d in decodes if d is not prefill]   # a worker taking both roles pairs with another
        decode = self._policy.pick_decode(others or decodes, num_tokens)
        return prefill, decode, self._disagg.decide(names, prefill, decode, decode_busy=decode.queue() > 0)

    async def _prefill(self, prefill: Worker, prompt: list[int],
                       layerwise_transfer_id: str = "") -> worker_pb2.PrefillResponse:
        sampling = self._sampling(len(prompt) - len(self.request.prompt_token_ids)) if self._stream_prefill_token \
            else None
        request = worker_pb2.PrefillRequest(request_id=self._attempt_id(), prompt_token_ids=prompt,
                                            sampling=sampling, cache_salt=self.request.cache_salt,
                                            layerwise_transfer_id=layerwise_transfer_id)
        queued = self._disagg.costs.enqueue(prefill.address,
                                            len(prompt) - self.state.decision.prefill_cached_tokens)  # as estimated
        started = time.monotonic()
        with self._pool.busy(prefill), client_span(PREFILL_METHOD) as metadata:
            call = worker_pb2_grpc.PrefillStub(prefill.channel).Prefill(request, timeout=self._time_left(),
                                                                        metadata=metadata)
            try:
                response = await call
            except grpc.aio.AioRpcError as exc:
                raise self._failure(StreamFailed.of_rpc_error(exc), prefill) from exc
            finally:
                call.cancel()  # no-op once done; a cancelled request aborts the prefill
                queued.done()
        self._prefilled_at = time.monotonic()
        self.state.prefill_seconds = self._prefilled_at - started
        prefill.published_rate(response.prefill_tokens_per_s)
        return response

    async def _local_chunks(self, decode: Worker, prompt: list[int]) -> AsyncIterator[worker_pb2.DecodeResponse]:
        """Decode computes the prompt itself (no KV handle): the colocated path."""
        self.state.decode = decode
        num_to_compute = len(prompt) - self.state.decision.decode_cached_tokens  # as the policy estimated
        queued = self._disagg.costs.enqueue(decode.address, num_to_compute)
        request = worker_pb2.DecodeRequest(request_id=self._attempt_id(), prompt_token_ids=prompt,
                                           sampling=self._sampling(len(prompt) - len(self.request.prompt_token_ids)),
                                           cache_salt=self.request.cache_salt)
        try:
            async for chunk in self._decode_call(decode, request):
                if chunk.token_ids:   # the prompt is computed: the first token is out
                    queued.done()
                yield chunk
        finally:
            queued.done()

    async def _decode_chunks(self, decode: Worker, prompt: list[int], num_left: int,
                             prefilled: worker_pb2.PrefillResponse) -> AsyncIterator[worker_pb2.DecodeResponse]:
        """Decode's stream; with first_token_from=prefill, prefill's token first and decode continuing
        from prompt + that token (no last-token recompute on decode, first token before the KV moves)."""
        sampling = self._sampling(len(prompt) - len(self.request.prompt_token_ids))
        if self._stream_prefill_token:
            first = worker_pb2.DecodeResponse(token_ids=[prefilled.first_token_id], text=prefilled.first_text)
            if prefilled.finish_reason == common_pb2.FINISH_REASON_STOP or num_left == 1:
                first.finish_reason = prefilled.finish_reason or common_pb2.FINISH_REASON_LENGTH
                self._pool.release_kv_soon(self.state.prefill, prefilled.kv)   # no decode will pull it
                yield first
                return
            yield first
            prompt = [*prompt, prefilled.first_token_id]
            sampling.max_tokens -= 1
        self.state.decode = decode
        request = worker_pb2.DecodeRequest(request_id=self._attempt_id(), prompt_token_ids=prompt, sampling=sampling,
                                           kv=prefilled.kv, cache_salt=self.request.cache_salt)
        handed_off = False
        async for chunk in self._decode_call(decode, request):
            if not handed_off and chunk.token_ids:
                handed_off = True
                handoff_s = time.monotonic() - self._prefilled_at
                self._disagg.costs.observe_handoff(handoff_s)
                if not self._stream_prefill_token:  # else the first token was prefill's
                    self.state.handoff_seconds = handoff_s
            yield chunk

    async def _layerwise_chunks(self, prefill: Worker, decode: Worker,
                                prompt: list[int]) -> AsyncIterator[worker_pb2.DecodeResponse]:
        """Decode first: it reserves blocks for the prompt and reads each layer as prefill, started
        at the same time, writes it. Either failing ends both (the other is cancelled); the caller
        retries elsewhere."""
        handle = layerwise_handle(prefill, len(prompt))
        self.state.decode = decode
        request = worker_pb2.DecodeRequest(request_id=self._attempt_id(), prompt_token_ids=prompt,
                                           sampling=self._sampling(len(prompt) - len(self.request.prompt_token_ids)),
                                           kv=handle, cache_salt=self.request.cache_salt)
        prefilling = asyncio.ensure_future(self._prefill(prefill, prompt, handle.transfer_id))
        finished, first_token_at = False, None
        try:
            async with aclosing(until_prefill_fails(self._decode_call(decode, request), prefilling)) as chunks:
                async for chunk in chunks:
                    if first_token_at is None and chunk.token_ids:
                        first_token_at = time.monotonic()
                        if prefilling.done():
                            self._disagg.costs.observe_handoff(first_token_at - self._prefilled_at)
                    if chunk.finish_reason:
                        if not prefilling.done() and chunk.token_ids:  # the tokens now, the figures once it answers
                            yield worker_pb2.DecodeResponse(token_ids=chunk.token_ids, text=chunk.text)
                            chunk.ClearField("token_ids")
                            chunk.ClearField("text")
                        await self._record_layerwise_prefill(prefilling, first_token_at)
                        finished = True
                        yield chunk
                        return   # the request is done: a prefill failing from here changes nothing
                    yield chunk
        finally:
            if not prefilling.done():
                prefilling.cancel()   # the prefill request is aborted, its blocks freed
            elif not prefilling.cancelled():
                prefilling.exception()   # retrieved: a failure after the request ended is not an error
            if not finished:
                self._pool.release_kv_soon(prefill, handle)   # decode may never have read it

    async def _record_layerwise_prefill(self, prefilling: asyncio.Future, first_token_at: float | None) -> None:
        """Prefill's figures for the last message. Decode can finish before prefill's answer arrives
        (it reads the KV once the last step is done; prefill answers a step later): wait for it a
        moment, no longer (a stalled prefill that decode gave up on and computed without)."""
        # every token is out: never raise here
        await asyncio.wait({prefilling}, timeout=max(0.0, min(LAYERWISE_PREFILL_GRACE_S, self._seconds_left())))
        if not prefilling.done() or prefilling.cancelled() or prefilling.exception() is not None:
            return   # every token is out: a late or failed prefill costs the figures only
        self.state.record_prefill(prefilling.result())
        if first_token_at is not None:
            self.state.handoff_seconds = first_token_at - self._prefilled_at

    async def _decode_call(self, decode: Worker,
                           request: worker_pb2.DecodeRequest) -> AsyncIterator[worker_pb2.DecodeResponse]:
        """Decode's messages, over the worker's shared call or a call of its own (gateway/decode_streams.py);
        closing this early (the client went away) aborts the decode, which frees its blocks."""
        with self._pool.busy(decode), client_span(DECODE_METHOD) as metadata:
            chunks = (decode.decode_streams().stream(request, self._time_left(), metadata) if self._decode_streams
                      else decode_call(decode.channel, request, self._time_left(), metadata))
            try:
                async with aclosing(chunks):
                    async for chunk in chunks:
                        decode.published_rate(chunk.prefill_tokens_per_s)   # its last message has them
                        decode.published_step(chunk.decode_step_s)
                        yield chunk
            except StreamFailed as failed:
                raise self._failure(failed, decode) from failed

    def _sampling(self, num_generated: int) -> common_pb2.SamplingParams:
        sampling = common_pb2.SamplingParams()
        sampling.CopyFrom(self.request.sampling)
        sampling.max_tokens -= num_generated
        return sampling

    def _attempt_id(self) -> str:
        """Engines need a fresh id per attempt (a failed one may still be known to a live worker)."""
        n = self.state.num_failovers + self.state.num_moves
        return self.request.request_id if n == 0 else f"{self.request.request_id}-retry{n}"

    def _seconds_left(self) -> float:
        """Until the request's deadline (< 0 once past it)."""
        return self._deadline - asyncio.get_running_loop().time()

    def _time_left(self) -> float:
        left = self._seconds_left()
        if left <= 0:
            raise errors.DeadlineExceeded(f"request {self.request.request_id} ran out of time")
        return left

    def _failure(self, failed: StreamFailed, worker: Worker) -> Exception:
        """The error to raise: _Retry (another worker may do it) or the domain error."""
        if failed.code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return errors.DeadlineExceeded(f"request {self.request.request_id} ran out of time on {worker.address}")
        error = failed.error
        if isinstance(error, errors.InternalError):  # the worker's own failure on this request: not retried
            return error
        if failed.code not in RETRYABLE_CODES and not isinstance(error, RETRYABLE):
            return error
        if failed.code == grpc.StatusCode.UNAVAILABLE:
            self._pool.mark_down(worker)
        self._excluded.add(worker.address)
        return _Retry(errors.WorkerFailed(f"{worker.role} worker {worker.address} failed: {failed.details}"))

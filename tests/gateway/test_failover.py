"""Failover, admission and limits of the gateway against in-process fake workers (the real-process
version, with SIGKILLed workers, is tests/e2e/test_gateway_users.py)."""

import time

import aiohttp
import grpc
import pytest

from gateway import request_run
from gateway.server import Gateway
from pdmesh.client import generate, make_request, stream_generate
from pdmesh.config import GatewaySettings
from pdmesh.grpc_errors import abort_args
from tests.gateway.fake_workers import FakeWorker


async def _mesh(tiny_llama_dir, decodes: list[FakeWorker], **settings):
    prefill = FakeWorker("prefill")
    prefill_address = await prefill.server.start("127.0.0.1", 0)
    decode_addresses = [await d.server.start("127.0.0.1", 0) for d in decodes]
    gateway = Gateway(GatewaySettings(port=0, prefill_workers=[prefill_address], decode_workers=decode_addresses,
                                      tokenizer=str(tiny_llama_dir), route_policy="round_robin", **settings))
    return gateway, await gateway.start(), prefill, decode_addresses


async def _stop(gateway, workers) -> None:
    await gateway.stop(0)
    for worker in workers:
        await worker.server.stop(0)


async def test_decode_failing_mid_stream_resumes_on_another_from_the_tokens_sent(tiny_llama_dir):
    dying, healthy = FakeWorker("decode", fail_after=2), FakeWorker("decode")
    gateway, address, prefill, addresses = await _mesh(tiny_llama_dir, [dying, healthy])
    dying_first = sorted(addresses)[0] == addresses[0]
    if not dying_first:  # round robin starts at the lowest address: make that the dying one
        dying.fail_after, healthy.fail_after = None, 2
        dying, healthy = healthy, dying
    try:
        token_ids, _, last = await generate(address, make_request([0, 7, 9, 11, 13], max_tokens=5, request_id="r1"))
    finally:
        await _stop(gateway, [prefill, dying, healthy])
    # The fake decode echoes its prompt: the first streamed 0, 7 then died; the second got prompt + [0, 7]
    # and 3 tokens to go, and echoed the first 3 of that longer prompt.
    assert token_ids == [0, 7, 0, 7, 9]
    resumed = healthy.requests[0]
    assert (list(resumed.prompt_token_ids), resumed.sampling.max_tokens) == ([0, 7, 9, 11, 13, 0, 7], 3)
    assert [list(r.prompt_token_ids) for r in prefill.requests] == [[0, 7, 9, 11, 13], [0, 7, 9, 11, 13, 0, 7]]
    assert resumed.request_id == f"{prefill.requests[0].request_id}-retry1"
    assert (last.transfer.num_failovers, last.transfer.resumed_at_token, last.usage.completion_tokens) == (1, 2, 5)


async def test_decode_failing_before_its_first_token_is_retried_invisibly(tiny_llama_dir):
    broken, healthy = FakeWorker("decode", fail_decode=True), FakeWorker("decode", fail_decode=True)
    gateway, address, prefill, addresses = await _mesh(tiny_llama_dir, [broken, healthy])
    (healthy if sorted(addresses)[1] == addresses[1] else broken).fail_decode = False  # the second pick works
    try:
        token_ids, _, last = await generate(address, make_request([0, 7, 9], max_tokens=3))
    finally:
        await _stop(gateway, [prefill, broken, healthy])
    assert token_ids == [0, 7, 9]
    assert (last.transfer.num_failovers, last.transfer.resumed_at_token) == (1, 0)


async def test_a_request_cut_on_every_decode_retries_one_that_is_back(tiny_llama_dir):
    """Connections reset on both decodes in turn (the fault campaign's drop_decode_stream, 2 s apart):
    the request failed on each, yet both serve again a moment later. It resumes on one of them, not
    UNAVAILABLE (within its attempts; the pool still skips a worker cooling down)."""
    first, second = FakeWorker("decode"), FakeWorker("decode")
    first.num_calls_to_cut = second.num_calls_to_cut = 1
    gateway, address, prefill, addresses = await _mesh(tiny_llama_dir, [first, second], worker_cooldown_s=0.2)
    try:
        token_ids, _, last = await generate(address, make_request([0, 7, 9, 11, 13, 15], max_tokens=6))
    finally:
        await _stop(gateway, [prefill, first, second])
    assert len(token_ids) == 6 and last.transfer.num_failovers == 2
    assert (len(first.requests), len(second.requests)) in ((2, 1), (1, 2))


async def test_a_workers_own_internal_error_is_not_retried_but_a_torn_down_call_is(tiny_llama_dir):
    """A worker's handler failing on the request (its InternalError: a bug, what the engine refused) would
    fail on any worker: the client gets INTERNAL at once. INTERNAL with no such name (the transport's,
    a call torn down) is a failed worker: retried on the other."""
    first, second = FakeWorker("decode"), FakeWorker("decode")
    gateway, address, prefill, addresses = await _mesh(tiny_llama_dir, [first, second])
    # round robin: the lowest address first, then the other
    picked_first, picked_second = (first, second) if sorted(addresses)[0] == addresses[0] else (second, first)
    try:
        picked_first.decode_status = abort_args(RuntimeError("engine refused the request"))
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await generate(address, make_request([0, 7, 9], max_tokens=3))
        assert caught.value.code() == grpc.StatusCode.INTERNAL
        assert "engine refused the request" in caught.value.details()
        assert (len(prefill.requests), len(first.requests) + len(second.requests)) == (1, 1)  # no second attempt

        picked_first.decode_status = None
        picked_second.call_status = (grpc.StatusCode.INTERNAL, "Received RST_STREAM with error code 2")
        token_ids, _, last = await generate(address, make_request([0, 7, 9], max_tokens=3))
        assert (token_ids, last.transfer.num_failovers) == ([0, 7, 9], 1)
    finally:
        await _stop(gateway, [prefill, first, second])


async def test_admission_limit_answers_resource_exhausted(tiny_llama_dir):
    decode = FakeWorker("decode")
    gateway, address, prefill, _ = await _mesh(tiny_llama_dir, [decode], max_in_flight=0)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await generate(address, make_request([0, 7], max_tokens=1))
    finally:
        await _stop(gateway, [prefill, decode])
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert err.value.details() == "0 requests in flight (limit 0); retry later"


@pytest.mark.parametrize("request_kwargs, message", [
    ({"prompt": [0] * 9, "max_tokens": 1}, "prompt has 9 tokens; this gateway's limit is 8"),
    ({"prompt": [0, 5], "max_tokens": 5}, "max_tokens 5 is above this gateway's limit of 4"),
])
async def test_per_request_limits_are_invalid_argument(tiny_llama_dir, request_kwargs, message):
    decode = FakeWorker("decode")
    gateway, address, prefill, _ = await _mesh(tiny_llama_dir, [decode], max_prompt_tokens=8, max_tokens_limit=4)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await generate(address, make_request(**request_kwargs))
    finally:
        await _stop(gateway, [prefill, decode])
    assert (err.value.code(), err.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT, message)


@pytest.mark.parametrize("path, body", [("/v1/completions", {"prompt": [0, 7]}),
                                        ("/v1/completions", {"prompt": [0, 7], "max_tokens": None}),
                                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})])
async def test_an_openai_request_without_max_tokens_gets_the_gateways_limit_not_a_refusal(tiny_llama_dir, path, body):
    """vLLM's defaults (16 for a completion that leaves max_tokens out, the rest of the 128-token
    context for a null one or a chat) are above the limit of 4: the gateway sends its limit instead of
    refusing a request the client wrote correctly."""
    decode = FakeWorker("decode")
    gateway, _, prefill, _ = await _mesh(tiny_llama_dir, [decode], max_tokens_limit=4, http_port=0)
    try:
        async with aiohttp.ClientSession() as session, \
                session.post(f"http://{gateway.http_address}{path}", json=body) as response:
            status = response.status
    finally:
        await _stop(gateway, [prefill, decode])
    assert (status, [r.sampling.max_tokens for r in decode.requests]) == (200, [4])


async def test_api_keys_gate_generate_and_name_the_tenant(tiny_llama_dir):
    decode = FakeWorker("decode")
    gateway, address, prefill, _ = await _mesh(tiny_llama_dir, [decode], api_keys={"sk-a": "a", "sk-b": "b"})
    try:
        for api_key in [None, "sk-nope"]:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await generate(address, make_request([0, 7], max_tokens=1), api_key=api_key)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        for api_key in ["sk-a", "sk-b", "sk-a"]:
            await generate(address, make_request([0, 7], max_tokens=1), api_key=api_key)
    finally:
        await _stop(gateway, [prefill, decode])
    salts = [r.cache_salt for r in prefill.requests]
    assert salts[0] == salts[2] != salts[1] and len(salts[0]) == 32   # one salt per tenant, on both workers
    assert [r.cache_salt for r in decode.requests] == salts


async def test_layerwise_prefill_failing_cancels_the_waiting_decode_and_retries_both(tiny_llama_dir):
    """Layer-wise: decode waits for KV while prefill computes; the prefill dying must not leave it
    waiting (it is cancelled, freeing its reservation) and the request is retried."""
    dying, healthy = FakeWorker("prefill", fail_prefill=True), FakeWorker("prefill")
    decode = FakeWorker("decode")
    prefill_addresses = [await w.server.start("127.0.0.1", 0) for w in (dying, healthy)]
    decode_address = await decode.server.start("127.0.0.1", 0)
    if sorted(prefill_addresses)[0] != prefill_addresses[0]:  # round robin picks the lowest address first
        dying.fail_prefill, healthy.fail_prefill = False, True
        dying, healthy = healthy, dying
    decode.layerwise_prefill = healthy
    gateway = Gateway(GatewaySettings(port=0, prefill_workers=prefill_addresses, decode_workers=[decode_address],
                                      tokenizer=str(tiny_llama_dir), route_policy="round_robin",
                                      kv_flow="layerwise"))
    address = await gateway.start()
    try:
        token_ids, _, last = await generate(address, make_request([0, 7, 9], max_tokens=3, request_id="r1"))
    finally:
        await _stop(gateway, [dying, healthy, decode])
    assert token_ids == [0, 7, 9]
    assert (last.transfer.num_failovers, decode.num_cancelled) == (1, 1)
    first, second = decode.requests
    assert (first.kv.layerwise, first.kv.transfer_id) == (True, dying.requests[0].layerwise_transfer_id)
    assert second.kv.transfer_id == healthy.requests[0].layerwise_transfer_id != first.kv.transfer_id
    assert len(first.kv.transfer_id) >= 24 and not first.kv.block_ids and first.kv.num_tokens == 3
    assert dying.released == [first.kv.transfer_id]  # nothing left pinned on it, were it alive


async def _layerwise_mesh(tiny_llama_dir, prefill_delay_s: float):
    """A layer-wise gateway whose decode finishes at once (its last token with the finish, as vLLM's
    does) while prefill answers after prefill_delay_s."""
    prefill, decode = FakeWorker("prefill"), FakeWorker("decode")
    prefill.prefill_delay_s, decode.finish_with_last_token = prefill_delay_s, True
    prefill_address = await prefill.server.start("127.0.0.1", 0)
    decode_address = await decode.server.start("127.0.0.1", 0)
    gateway = Gateway(GatewaySettings(port=0, prefill_workers=[prefill_address], decode_workers=[decode_address],
                                      tokenizer=str(tiny_llama_dir), kv_flow="layerwise"))
    return gateway, await gateway.start(), prefill, decode


@pytest.mark.parametrize("max_tokens", [1, 3])
async def test_layerwise_tokens_stream_before_prefill_answers_and_the_last_message_has_its_figures(
        tiny_llama_dir, monkeypatch, max_tokens):
    """Layer-wise decode can finish (its KV read once prefill's last step is done) before prefill's
    answer reaches the gateway: the tokens go out at once, and the last message waits for prefill's
    figures (computed tokens, its call's time, the handoff: < 0 here, the token came first)."""
    monkeypatch.setattr(request_run, "LAYERWISE_PREFILL_GRACE_S", 10.0)
    gateway, address, prefill, decode = await _layerwise_mesh(tiny_llama_dir, prefill_delay_s=1.0)
    arrivals = []
    try:
        started = time.monotonic()
        async for response in stream_generate(address, make_request([5, 7, 9], max_tokens=max_tokens)):
            arrivals.append((time.monotonic() - started, list(response.token_ids), response))
    finally:
        await _stop(gateway, [prefill, decode])
    *token_messages, (finished_at, last_ids, last) = arrivals
    assert [ids for _, ids, _ in token_messages] == [[5], [7], [9]][:max_tokens] and last_ids == []
    assert token_messages[-1][0] < 0.8 and finished_at >= 1.0   # the tokens did not wait for prefill
    transfer = last.transfer
    assert (last.usage.completion_tokens, transfer.prefill_computed_tokens, transfer.layerwise) == (max_tokens, 3,
                                                                                                     False)
    assert transfer.prefill_seconds >= 1.0 and -transfer.prefill_seconds < transfer.handoff_seconds < -0.2


async def test_a_layerwise_prefill_that_does_not_answer_delays_the_last_message_a_moment_only(
        tiny_llama_dir, monkeypatch):
    """Decode gave up on a stalled prefill and computed the prompt itself: its tokens are the
    request's, and the last message goes after the grace without prefill's figures."""
    monkeypatch.setattr(request_run, "LAYERWISE_PREFILL_GRACE_S", 0.2)
    gateway, address, prefill, decode = await _layerwise_mesh(tiny_llama_dir, prefill_delay_s=30.0)
    try:
        started = time.monotonic()
        token_ids, _, last = await generate(address, make_request([5, 7, 9], max_tokens=2))
        took = time.monotonic() - started
    finally:
        await _stop(gateway, [prefill, decode])
    assert (token_ids, last.transfer.prefill_computed_tokens, last.transfer.prefill_seconds) == ([5, 7], 0, 0.0)
    assert 0.2 <= took < 5

"""Gateway validation, error mapping and pairing against in-process fake workers."""

import asyncio
import re
import threading
import subprocess
import sys

import grpc
import pytest

from gateway.server import Gateway
from gateway.tokenizer import PromptTokenizer
from pdmesh.client import generate, make_request
from pdmesh.config import GatewaySettings
from pdmesh.v1 import common_pb2, generate_pb2
from tests.gateway.fake_workers import COMPAT, FakeWorker


async def _start(tiny_llama_dir, decode_compat=COMPAT, kv_address="127.0.0.1:1", fail_decode=False,
                 first_token_from="decode", disagg_policy="remote"):
    prefill = FakeWorker("prefill", kv_address=kv_address)
    decode = FakeWorker("decode", decode_compat, fail_decode=fail_decode)
    prefill_address = await prefill.server.start("127.0.0.1", 0)
    decode_address = await decode.server.start("127.0.0.1", 0)
    gateway = Gateway(GatewaySettings(port=0, prefill_workers=[prefill_address], decode_workers=[decode_address],
                                      tokenizer=str(tiny_llama_dir), first_token_from=first_token_from,
                                      disagg_policy=disagg_policy))
    return gateway, await gateway.start(), prefill, decode


@pytest.fixture
async def mesh(tiny_llama_dir):
    gateway, address, prefill, decode = await _start(tiny_llama_dir)
    yield address, prefill, decode
    await gateway.stop(0)
    await prefill.server.stop(0)
    await decode.server.stop(0)


async def test_request_flows_prefill_then_decode_with_the_same_ids(mesh):
    address, prefill, decode = mesh
    token_ids, text, last = await generate(address, make_request([0, 7, 9], max_tokens=2, request_id="r1"))
    assert (token_ids, text) == ([0, 7], "<0><7>")
    (mesh_id,) = {r.request_id for r in prefill.requests + decode.requests}  # the gateway's id, on both workers
    assert re.fullmatch("r1-[0-9a-f]{32}", mesh_id) and last.request_id == "r1"  # the client's: a label echoed back
    assert decode.requests[0].kv.transfer_id == f"t-{mesh_id}"
    assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert (last.usage.prompt_tokens, last.usage.completion_tokens, last.usage.total_tokens) == (3, 2, 5)


async def test_the_last_message_times_the_prefill_call_and_the_handoff_after_it(mesh):
    address, prefill, _ = mesh
    prefill.prefill_delay_s = 0.2
    _, _, last = await generate(address, make_request([0, 7, 9], max_tokens=2))
    assert last.transfer.prefill_seconds >= 0.2 and 0 < last.transfer.handoff_seconds < last.transfer.prefill_seconds


async def test_text_prompt_is_tokenized_with_the_models_tokenizer(mesh):
    address, prefill, _ = mesh
    await generate(address, make_request("Hello world", max_tokens=1))
    assert list(prefill.requests[0].prompt_token_ids) == [0, 42, 884, 593]  # <s> He llo ' world'


@pytest.mark.parametrize("request_kwargs, code, message", [
    ({"prompt": ""}, grpc.StatusCode.INVALID_ARGUMENT, "prompt is empty"),
    ({"prompt": []}, grpc.StatusCode.INVALID_ARGUMENT, "prompt is empty"),
    ({"prompt": "hi", "max_tokens": 0}, grpc.StatusCode.INVALID_ARGUMENT, "max_tokens must be > 0, got 0"),
    ({"prompt": "hi", "max_tokens": -3}, grpc.StatusCode.INVALID_ARGUMENT, "max_tokens must be > 0, got -3"),
    ({"prompt": [5] * 128}, grpc.StatusCode.INVALID_ARGUMENT, "prompt has 128 tokens; the model's context is 128"),
    ({"prompt": [5] * 100, "max_tokens": 29}, grpc.StatusCode.INVALID_ARGUMENT, "exceeds the model's context"),
    ({"prompt": [5, 4096]}, grpc.StatusCode.INVALID_ARGUMENT, r"token ids \[4096\] outside the vocabulary"),
    ({"prompt": "hi", "temperature": -1.0}, grpc.StatusCode.INVALID_ARGUMENT, "temperature must be a finite number"),
    ({"prompt": "hi", "temperature": float("nan")}, grpc.StatusCode.INVALID_ARGUMENT, "got nan"),
    ({"prompt": "hi", "temperature": float("inf")}, grpc.StatusCode.INVALID_ARGUMENT, "got inf"),
    ({"prompt": "hi", "temperature": 2.5}, grpc.StatusCode.INVALID_ARGUMENT, r"in \[0, 2.0\], got 2.5"),
    ({"prompt": "hi", "top_p": float("nan")}, grpc.StatusCode.INVALID_ARGUMENT, r"top_p must be in \(0, 1\]"),
    ({"prompt": "hi", "stop": ["ok", ""]}, grpc.StatusCode.INVALID_ARGUMENT, "stop cannot contain an empty string"),
])
async def test_bad_requests_get_invalid_argument_and_reach_no_worker(mesh, request_kwargs, code, message):
    address, prefill, decode = mesh
    kwargs = {"max_tokens": 4, **request_kwargs}
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await generate(address, make_request(kwargs.pop("prompt"), **kwargs))
    assert info.value.code() == code
    assert re.search(message, info.value.details())
    assert prefill.requests == [] and decode.requests == []


async def test_a_text_prompt_longer_than_any_context_is_refused_untokenized_and_others_tokenize_off_the_loop(
        mesh, monkeypatch):
    """3 MB of text cannot fit 128 tokens: refused before the tokenizer sees it (it would take seconds, and
    stall every stream meanwhile). A text that may fit is tokenized on a worker thread, not the event loop."""
    address, prefill, decode = mesh
    threads = []
    encode = PromptTokenizer.encode

    def spying_encode(self, text, add_special_tokens=True):
        threads.append(threading.current_thread())
        return encode(self, text, add_special_tokens)

    monkeypatch.setattr(PromptTokenizer, "encode", spying_encode)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await generate(address, make_request("x" * 3_000_000, max_tokens=1))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "prompt of 3000000 characters is longer than the model's context of 128 tokens" in info.value.details()
    assert (threads, prefill.requests, decode.requests) == ([], [], [])
    await generate(address, make_request("Hello world", max_tokens=1))
    assert len(threads) == 1 and threads[0] is not threading.main_thread()


async def test_unknown_model_is_not_found(mesh):
    address, _, _ = mesh
    request = make_request("hi", max_tokens=1)
    request.model = "gpt-5"
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await generate(address, request)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert info.value.details() == "model 'gpt-5' is not served here; available: ['tiny-llama']"


async def test_mismatched_worker_layouts_fail_precondition(tiny_llama_dir):
    other = common_pb2.CompatInfo()
    other.CopyFrom(COMPAT)
    other.block_size = 64
    gateway, address, prefill, decode = await _start(tiny_llama_dir, decode_compat=other)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await generate(address, make_request("hi", max_tokens=1))
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "block_size: prefill=32 decode=64" in info.value.details()
        assert prefill.requests == []
    finally:
        await gateway.stop(0)
        await prefill.server.stop(0)
        await decode.server.stop(0)


async def test_unreachable_workers_are_unavailable(tiny_llama_dir):
    gateway = Gateway(GatewaySettings(port=0, prefill_workers=["127.0.0.1:1"], decode_workers=["127.0.0.1:1"],
                                      tokenizer=str(tiny_llama_dir), worker_wait_s=0.5))
    address = await gateway.start()
    try:
        with pytest.raises(grpc.aio.AioRpcError) as info:   # after waiting 0.5 s for a worker to come back
            await generate(address, make_request("hi", max_tokens=1))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "no reachable decode worker" in info.value.details()
    finally:
        await gateway.stop(0)


async def test_list_models(mesh):
    address, _, _ = mesh
    from pdmesh.v1 import generate_pb2_grpc

    async with grpc.aio.insecure_channel(address) as channel:
        response = await generate_pb2_grpc.GenerationStub(channel).ListModels(generate_pb2.ListModelsRequest())
    assert [(m.id, m.max_model_len) for m in response.models] == [("tiny-llama", 128)]


def test_gateway_imports_neither_torch_nor_vllm():
    code = ("import sys, gateway.server, gateway.__main__, pdmesh.client, pdmesh.cluster;"
            "print(sorted(m for m in ('torch', 'vllm') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


async def test_failed_decode_releases_the_prefill_kv_at_once(tiny_llama_dir):
    """Through the prefill worker's own service: the gateway never calls the KV port (mesh peers only).
    The only decode fails every call yet answers GetInfo: each of the request's attempts retries it
    (it may have been a reset connection), and each attempt's prefill KV is released."""
    gateway, address, prefill, decode = await _start(tiny_llama_dir, fail_decode=True)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await generate(address, make_request([0, 5], max_tokens=1, request_id="r9"))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert re.fullmatch(r"decode worker 127\.0\.0\.1:\d+ failed: decode engine died", info.value.details())
        attempts = [f"t-{request.request_id}" for request in prefill.requests]
        assert len(attempts) == GatewaySettings().max_attempts
        assert sorted(await released(prefill, num_expected=len(attempts))) == sorted(attempts)
    finally:
        await gateway.stop(0)
        await prefill.server.stop(0)
        await decode.server.stop(0)


async def released(prefill, timeout_s: float = 5.0, num_expected: int = 1) -> list[str]:
    """The gateway releases KV in the background: the transfers released within timeout_s."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while len(prefill.released) < num_expected and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.01)
    return prefill.released


async def _stop(gateway, prefill, decode):
    await gateway.stop(0)
    await prefill.server.stop(0)
    await decode.server.stop(0)


async def test_first_token_from_prefill_streams_it_and_decode_continues_after_it(tiny_llama_dir):
    gateway, address, prefill, decode = await _start(tiny_llama_dir, first_token_from="prefill")
    try:
        token_ids, text, last = await generate(address, make_request([0, 7, 9], max_tokens=3, request_id="r2"))
        assert prefill.requests[0].sampling.max_tokens == 3  # prefill samples with the request's params
        (decode_request,) = decode.requests
        assert list(decode_request.prompt_token_ids) == [0, 7, 9, 777]
        assert decode_request.sampling.max_tokens == 2
        assert (token_ids, text) == ([777, 0, 7], "<777><0><7>")
        assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (3, 3)
        assert last.transfer.prefill_seconds > 0 and last.transfer.handoff_seconds == 0  # the first token was prefill's
    finally:
        await _stop(gateway, prefill, decode)


@pytest.mark.parametrize("max_tokens, prefill_finish", [
    (1, common_pb2.FINISH_REASON_LENGTH),
    (5, common_pb2.FINISH_REASON_STOP),  # prefill's token was EOS or hit a stop string
])
async def test_prefill_token_that_ends_the_request_skips_decode_and_frees_the_kv(
        tiny_llama_dir, max_tokens, prefill_finish):
    gateway, address, prefill, decode = await _start(tiny_llama_dir, first_token_from="prefill")
    prefill.prefill_finish = prefill_finish
    try:
        token_ids, _, last = await generate(address, make_request([0, 5], max_tokens=max_tokens, request_id="r3"))
        assert (token_ids, last.finish_reason, last.usage.completion_tokens) == ([777], prefill_finish, 1)
        assert decode.requests == []
        assert await released(prefill) == [f"t-{prefill.requests[0].request_id}"]
    finally:
        await _stop(gateway, prefill, decode)


async def test_local_prefill_sends_decode_no_handle_and_reaches_no_prefill(tiny_llama_dir):
    gateway, address, prefill, decode = await _start(tiny_llama_dir, disagg_policy="local")
    try:
        token_ids, _, last = await generate(address, make_request([0, 7, 9], max_tokens=2, request_id="r5"))
        assert token_ids == [0, 7]
        assert prefill.requests == []
        (decode_request,) = decode.requests
        assert not decode_request.HasField("kv") and list(decode_request.prompt_token_ids) == [0, 7, 9]
        assert (last.transfer.local_prefill, last.transfer.prefill_worker) == (True, "")
        assert last.usage.cached_prompt_tokens == 3  # what decode reported it did not compute
        assert gateway.generator.disagg.decisions == {(True, "policy"): 1}
    finally:
        await _stop(gateway, prefill, decode)


async def test_conditional_policy_follows_the_prompt_rates_the_workers_publish(tiny_llama_dir):
    """Each worker's rate is the one its engine measures, learnt from its answers (or its registry record):
    the first prompt goes remote (nothing published yet), then the cheaper side wins."""
    gateway, address, prefill, decode = await _start(tiny_llama_dir, disagg_policy="conditional")
    disagg = gateway.generator.disagg
    prefill.prefill_tokens_per_s = decode.prefill_tokens_per_s = 1e9
    try:
        locals_ = []
        for decode_rate in (1e9, 1.0, 1.0):   # what decode publishes in this request's answer
            decode.prefill_tokens_per_s = decode_rate
            locals_.append((await generate(address, make_request([0, 7, 9], max_tokens=2)))[2].transfer.local_prefill)
        assert locals_ == [False, True, False]   # unmeasured; 3 tokens here vs 20 ms handoff; 3 s here
        assert disagg.decisions == {(False, "unmeasured"): 1, (True, "cheaper_local"): 1, (False, "cheaper_remote"): 1}
        assert disagg.costs.handoff_s.num_samples == 2
        assert disagg.costs.queued_tokens == {f: 0 for f in disagg.costs.queued_tokens}  # nothing left counted
    finally:
        await _stop(gateway, prefill, decode)

"""Tenants apart (issue 30, item 7), attacked through the real gateway over gRPC against fake workers:
a request id chosen to name another tenant's request, a probe of another tenant's prefixes, a salt
computed from a tenant's name, one API key holding every admission slot."""

from __future__ import annotations

import asyncio
import hashlib
import re

import grpc

from gateway.server import Gateway
from pdmesh.client import generate, make_request
from pdmesh.config import GatewaySettings
from pdmesh.v1 import generate_pb2
from tests.gateway.fake_workers import FakeWorker

API_KEYS = {"sk-a": "a", "sk-b": "b"}


async def _gateway(tiny_llama_dir, prefill: FakeWorker, decode: FakeWorker, **settings) -> tuple[Gateway, str]:
    prefill_address = await prefill.server.start("127.0.0.1", 0)
    decode_address = await decode.server.start("127.0.0.1", 0)
    gateway = Gateway(GatewaySettings(port=0, prefill_workers=[prefill_address], decode_workers=[decode_address],
                                      tokenizer=str(tiny_llama_dir), api_keys=API_KEYS, **settings))
    return gateway, await gateway.start()


async def _stop(gateway: Gateway, *workers: FakeWorker) -> None:
    await gateway.stop(0)
    for worker in workers:
        await worker.server.stop(0)


async def _until(condition, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out waiting for the mesh"
        await asyncio.sleep(0.01)


async def test_a_cancel_under_another_tenants_request_id_leaves_that_request_untouched(tiny_llama_dir):
    """A's KV is pinned on prefill, its decode about to pull it. B sends a request with A's request id
    and goes away mid-prefill: the prefill worker frees the KV of the cancelled request's id (as the real
    servicer does). With the client's id reaching the workers, that was A's KV: A's pull failed."""
    prefill, decode = FakeWorker("prefill"), FakeWorker("decode")
    decode.kv_source, decode.decode_gate = prefill, asyncio.Event()
    gateway, address = await _gateway(tiny_llama_dir, prefill, decode)
    try:
        victim = asyncio.ensure_future(generate(address, make_request([0, 7, 9], max_tokens=2, request_id="victim"),
                                                api_key="sk-a"))
        await _until(lambda: prefill.held and decode.requests)   # A's KV pinned, its decode at the gate
        prefill.prefill_delay_s = 30.0
        attacker = asyncio.ensure_future(generate(address, make_request([5, 6], max_tokens=1, request_id="victim"),
                                                  api_key="sk-b"))
        await _until(lambda: len(prefill.requests) == 2)        # B's prefill runs on the worker
        prefill.prefill_delay_s = 0.0
        attacker.cancel()
        await asyncio.gather(attacker, return_exceptions=True)
        await _until(lambda: prefill.released_requests)         # the worker freed what B's request id holds
        decode.decode_gate.set()
        token_ids, _, last = await victim
    finally:
        await _stop(gateway, prefill, decode)
    a_id, b_id = (r.request_id for r in prefill.requests)
    assert re.fullmatch("victim-[0-9a-f]{32}", a_id) and re.fullmatch("victim-[0-9a-f]{32}", b_id) and a_id != b_id
    assert prefill.released_requests == [b_id]
    assert (token_ids, last.request_id, last.transfer.num_failovers) == ([0, 7], "victim", 0)
    assert [r.request_id for r in decode.requests] == [a_id] and prefill.held == {}


def _shape(last: generate_pb2.GenerateResponse) -> generate_pb2.GenerateResponse:
    """The last message without what differs between any two requests: the client's id and the times."""
    shape = generate_pb2.GenerateResponse()
    shape.CopyFrom(last)
    shape.ClearField("request_id")
    shape.transfer.prefill_seconds = shape.transfer.handoff_seconds = 0.0
    return shape


async def test_a_prompt_another_tenant_sent_answers_exactly_as_a_cold_one(tiny_llama_dir):
    """Conditional disaggregation computes a prompt on decode when decode likely holds its prefix; the
    answer's transfer.local_prefill says so. Unsalted, a prefix A sent was 'held' for B too: B could
    tell which prompts other tenants had lately sent."""
    prefill, decode = FakeWorker("prefill"), FakeWorker("decode")
    gateway, address = await _gateway(tiny_llama_dir, prefill, decode, disagg_policy="conditional")
    prefill.prefill_tokens_per_s, decode.prefill_tokens_per_s = 1e9, 1000.0   # as they publish them
    prompt, cold_prompt = [0, *range(100, 163)], [0, *range(200, 263)]   # 64 tokens: 2 blocks of the estimate's 32

    async def send(tokens: list[int], api_key: str) -> generate_pb2.GenerateResponse:
        # remote 0.02 s (the handoff) vs local 64 tokens at 1000/s = 0.064 s: cold prompts go remote; one
        # whose 63 tokens decode holds costs 0.001 s there and stays local
        gateway.generator.disagg.costs.handoff_s.value = 0.02
        return (await generate(address, make_request(tokens, max_tokens=1), api_key=api_key))[2]

    try:
        a_first, a_again = await send(prompt, "sk-a"), await send(prompt, "sk-a")
        b_probe, b_cold = await send(prompt, "sk-b"), await send(cold_prompt, "sk-b")
    finally:
        await _stop(gateway, prefill, decode)
    assert (a_first.transfer.local_prefill, a_again.transfer.local_prefill) == (False, True)  # A's own: held
    assert _shape(b_probe) == _shape(b_cold) and not b_probe.transfer.local_prefill
    # A's first goes remote before either worker has published its rate
    assert gateway.generator.disagg.decisions == {(False, "unmeasured"): 1, (False, "cheaper_remote"): 2,
                                                  (True, "cheaper_local"): 1}


async def _salts_sent(tiny_llama_dir, **settings) -> list[str]:
    """The cache salts one gateway sends the workers for tenant a, tenant b, and tenant a again."""
    prefill, decode = FakeWorker("prefill"), FakeWorker("decode")
    gateway, address = await _gateway(tiny_llama_dir, prefill, decode, **settings)
    try:
        for api_key in ["sk-a", "sk-b", "sk-a"]:
            await generate(address, make_request([0, 7], max_tokens=1), api_key=api_key)
    finally:
        await _stop(gateway, prefill, decode)
    assert [r.cache_salt for r in decode.requests] == [r.cache_salt for r in prefill.requests]
    return [r.cache_salt for r in prefill.requests]


async def test_a_tenants_salt_cannot_be_computed_from_its_name(tiny_llama_dir):
    """The salt is what names a tenant's blocks in the engines, the KV store and its Redis index: one
    computable from the tenant's name (sha256 of it, as before) lets anyone name them."""
    first = await _salts_sent(tiny_llama_dir, salt_secret="secret-1")
    second = await _salts_sent(tiny_llama_dir, salt_secret="secret-2")
    by_token = await _salts_sent(tiny_llama_dir, mesh_token="mesh-token-1")
    assert first == ["08b31455380bf98680964a7a61d8999a", "9ab5a4241458f4558a84c7526576fc00",
                     "08b31455380bf98680964a7a61d8999a"]   # HMAC-SHA256(secret, '["a", ""]'), 128 bits
    assert by_token == ["6e384c19604c42c7dfb7268be0391833", "1b6779daa0de1cf3f22ba7808f90d76e",
                        "6e384c19604c42c7dfb7268be0391833"]   # keyed by HMAC(mesh token, KEY_LABEL)
    assert len({first[0], second[0], by_token[0]}) == 3 and first[1] != second[1]
    unkeyed = hashlib.sha256("pdmesh-tenant\0a\0".encode()).hexdigest()[:32]
    assert unkeyed not in first + second + by_token


async def test_one_key_holding_its_slots_leaves_other_tenants_room(tiny_llama_dir):
    """Tenant a opens as many streams as the gateway admits in all, and holds them (their decodes do
    not finish: a slow reader holds a slot alike). It gets its own limit's worth; tenant b still gets in."""
    prefill, decode = FakeWorker("prefill"), FakeWorker("decode")
    decode.decode_gate = asyncio.Event()
    gateway, address = await _gateway(tiny_llama_dir, prefill, decode, max_in_flight=8, max_in_flight_per_tenant=4)

    async def send(api_key: str, first_token: int):
        try:
            return (await generate(address, make_request([first_token, 7], max_tokens=2), api_key=api_key))[0]
        except grpc.aio.AioRpcError as exc:
            return exc.code(), exc.details()

    try:
        holding = [asyncio.ensure_future(send("sk-a", 10 + i)) for i in range(8)]
        await _until(lambda: len(decode.requests) + sum(task.done() for task in holding) == 8)
        other = asyncio.ensure_future(send("sk-b", 99))
        await _until(lambda: len(decode.requests) == 5)   # b's request reached decode: it was admitted
        decode.decode_gate.set()
        results, b_tokens = await asyncio.gather(*holding), await other
    finally:
        await _stop(gateway, prefill, decode)
    refused = (grpc.StatusCode.RESOURCE_EXHAUSTED, "this API key's tenant has 4 requests in flight (its limit 4); "
                                                   "retry later")
    admitted = sorted(list(r.prompt_token_ids) for r in decode.requests[:4])   # a's (b's came 5th)
    assert sorted(r for r in results if isinstance(r, list)) == admitted     # the fake decode echoes its prompt
    assert [r for r in results if not isinstance(r, list)] == [refused] * 4
    assert b_tokens == [99, 7]
    admission = gateway.generator.admission
    assert (admission.num_in_flight, admission.tenants_in_flight) == (0, set())

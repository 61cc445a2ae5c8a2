"""The gateway as users meet it, on a real cluster: two prefill and two decode workers that find
each other through a real Redis registry, mTLS between gateway and workers, API keys with
per-tenant cache salts, the OpenAI HTTP API, prefix-aware routing over the KV store's index,
cancellation, admission control, deadlines, and failover when a worker process is SIGKILLed.

Tests that kill workers run last (the module keeps its cluster)."""

from __future__ import annotations

import asyncio
import json
import random

import aiohttp
import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.prefix_index import PrefixIndex
from pdmesh.client import auth_metadata, generate, make_request
from pdmesh.cluster import LocalCluster
from pdmesh.config import RegistrySettings, TlsSettings
from pdmesh.registry import RegistryWatcher
from pdmesh.tls import open_channel
from pdmesh.v1 import generate_pb2, generate_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.conftest import MESH_TOKEN
from tests.e2e.cluster_probes import (all_saved, kill_worker, stats_of, stream_generate, until_idle, until_indexed,
                                      until_left_registry, until_saved)
from tests.e2e.conftest import (FAILOVER_PROMPT, FAILOVER_SAMPLING, HOLD_TIMEOUT_S, MAX_TOKENS, USER_CHATS,
                                USER_TEXT_PROMPTS, in_process_gateway, mesh_channel, settled_stats)
from tests.e2e.worker_api import WORKER_API_METHODS, call_with_empty_request
from tests.tls_certs import make_certs

pytestmark = pytest.mark.vllm
BLOCK_SIZE = 32
KEY_A, KEY_B = "sk-tenant-a", "sk-tenant-b"
API_KEYS = {KEY_A: "tenant-a", KEY_B: "tenant-b"}
LONG = {"max_tokens": 2000, "ignore_eos": True}   # keeps a decode busy for seconds


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def gateway_tls(certs) -> TlsSettings:
    return TlsSettings(cert_file=certs.client_cert, key_file=certs.client_key, ca_file=certs.ca)


@pytest.fixture(scope="module")
def users_cluster(tiny_llama_dir, reference, redis, certs, tmp_path_factory):
    registry = ["--registry.redis_url", redis.url, "--registry.redis_password", redis.password]
    # Loads are never cut at their time budget here: the tests count exactly which tokens the store served.
    worker_args = ["--hold_timeout_s", str(HOLD_TIMEOUT_S), *registry, "--store.load_budget_min_s", "60",
                   "--store.redis_url", redis.url,
                   "--store.redis_password", redis.password, "--tls.cert_file", str(certs.server_cert),
                   "--tls.key_file", str(certs.server_key), "--tls.ca_file", str(certs.ca)]
    gateway_args = ["--http_port", "0", "--api_keys", json.dumps(API_KEYS), *registry,
                    "--kv_index_redis_url", redis.url, "--kv_index_redis_password", redis.password,
                    "--worker_tls.cert_file", str(certs.client_cert), "--worker_tls.key_file", str(certs.client_key),
                    "--worker_tls.ca_file", str(certs.ca)]
    with LocalCluster(tiny_llama_dir, tmp_path_factory.mktemp("users-cluster"), num_prefill=2, num_decode=2,
                      worker_args=worker_args, gateway_args=gateway_args, static_workers=False) as running:
        running.killed: list[str] = []
        yield running
        tls = TlsSettings(cert_file=certs.client_cert, key_file=certs.client_key, ca_file=certs.ca)
        for address in [a for a in running.prefill_addresses + running.decode_addresses if a not in running.killed]:
            stats = asyncio.run(settled_stats(address, tls))   # leak check: nothing pinned, no block in use
            assert (stats.num_held_transfers, stats.num_expired_transfers, stats.num_running_requests,
                    stats.kv_cache_usage) == (0, 0, 0, 0.0), address


def _openai(cluster: LocalCluster, api_key: str = KEY_A) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"http://{cluster.http_address}/v1", api_key=api_key, max_retries=0)


def _random_prompt(seed: str, num_tokens: int) -> list[int]:
    rng = random.Random(seed)
    return [0] + [rng.randrange(3, 1024) for _ in range(num_tokens - 1)]


async def test_openai_completions_stream_and_not_match_monolithic(users_cluster, reference):
    want = reference["runs"][5]
    async with _openai(users_cluster) as client:
        for i, prompt in enumerate(USER_TEXT_PROMPTS):
            completion = await client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=MAX_TOKENS,
                                                         temperature=0.0, extra_body={"return_token_ids": True})
            choice = completion.choices[0].to_dict()
            assert choice["token_ids"] == want["token_ids"][i]
            assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (
                len(want["prompt_token_ids"][i]), MAX_TOKENS)
            stream = await client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=MAX_TOKENS,
                                                     temperature=0.0, stream=True,
                                                     extra_body={"return_token_ids": True})
            chunks = [chunk.choices[0].to_dict() async for chunk in stream if chunk.choices]
            assert [t for c in chunks for t in c.get("token_ids") or []] == want["token_ids"][i]
            assert "".join(c["text"] for c in chunks) == choice["text"]
            assert chunks[-1]["finish_reason"] == "length"


async def test_openai_chat_uses_the_models_template_and_matches_vllm_chat(users_cluster, reference):
    want = reference["runs"][6]
    async with _openai(users_cluster) as client:
        chat = await client.chat.completions.create(model="tiny-llama", messages=USER_CHATS[0], max_tokens=MAX_TOKENS,
                                                    temperature=0.0, extra_body={"return_token_ids": True})
        as_dict = chat.to_dict()
        assert as_dict["prompt_token_ids"] == want["prompt_token_ids"][0]
        assert as_dict["choices"][0]["token_ids"] == want["token_ids"][0]
        stream = await client.chat.completions.create(model="tiny-llama", messages=USER_CHATS[0], stream=True,
                                                      max_tokens=MAX_TOKENS, temperature=0.0,
                                                      stream_options={"include_usage": True})
        chunks = [chunk async for chunk in stream]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == chat.choices[0].message.content
        assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (
            len(want["prompt_token_ids"][0]), MAX_TOKENS)
        models = await client.models.list()
        assert [m.id for m in models.data] == ["tiny-llama"]


async def test_raw_grpc_client_gets_the_same_tokens(users_cluster, reference):
    want = reference["runs"][5]
    for i, prompt in enumerate(USER_TEXT_PROMPTS):
        token_ids, _, last = await generate(users_cluster.gateway_address,
                                            make_request(prompt, max_tokens=MAX_TOKENS), api_key=KEY_B)
        assert token_ids == want["token_ids"][i]
        assert last.usage.prompt_tokens == len(want["prompt_token_ids"][i])


async def test_missing_or_wrong_api_key_is_unauthenticated(users_cluster):
    for metadata in [(), auth_metadata("sk-wrong"), (("authorization", "Basic abc"),)]:
        async with grpc.aio.insecure_channel(users_cluster.gateway_address) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in generate_pb2_grpc.GenerationStub(channel).Generate(
                        make_request("hi", max_tokens=2), metadata=metadata, timeout=30):
                    pass
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    async with _openai(users_cluster, "sk-wrong") as client:
        with pytest.raises(openai.AuthenticationError) as http_err:
            await client.completions.create(model="tiny-llama", prompt="hi", max_tokens=2)
    assert http_err.value.status_code == 401
    async with grpc.aio.insecure_channel(users_cluster.gateway_address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await generate_pb2_grpc.GenerationStub(channel).ListModels(generate_pb2.ListModelsRequest(), timeout=30)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    routes = [("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2}),
              ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
              ("GET", "/v1/models", None)]
    async with aiohttp.ClientSession() as session:   # no Authorization header at all (curl without -H)
        for method, path, body in routes:
            async with session.request(method, f"http://{users_cluster.http_address}{path}", json=body) as response:
                assert (response.status, response.headers["WWW-Authenticate"]) == (401, "Bearer"), path
                assert (await response.json())["error"]["type"] == "Unauthenticated"
    async with grpc.aio.insecure_channel(users_cluster.gateway_address) as channel:  # health needs no key
        health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert health.status == health_pb2.HealthCheckResponse.SERVING


async def test_workers_accept_only_clients_with_the_gateways_certificate(users_cluster, certs, gateway_tls):
    address = users_cluster.decode_addresses[0]
    rejected = [TlsSettings(), TlsSettings(ca_file=certs.ca),
                TlsSettings(cert_file=certs.other_client_cert, key_file=certs.other_client_key, ca_file=certs.ca)]
    for tls in rejected:
        async with open_channel(address, tls) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await worker_pb2_grpc.WorkerInfoStub(channel).GetInfo(worker_pb2.GetInfoRequest(), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    async with mesh_channel(address, gateway_tls) as channel:
        info = await worker_pb2_grpc.WorkerInfoStub(channel).GetInfo(worker_pb2.GetInfoRequest(), timeout=10)
    assert info.role == "decode"


# Every method a peer can call on a worker's KV port ("*": a response stream).
KV_PORT_METHODS = ["KVTransfer/Handshake", "KVTransfer/Open", "KVTransfer/Pull*", "KVTransfer/Release",
                   "KVTransfer/Watch", "KVStore/Lookup", "KVStore/Export"]




async def test_every_internal_service_refuses_callers_without_the_mesh_credentials(users_cluster, certs):
    """Worker API ports (mutual TLS): no certificate or one of another CA cannot connect, whatever the
    method. KV ports (the mesh token): every KVTransfer and KVStore method is refused without it."""
    strangers = [TlsSettings(), TlsSettings(ca_file=certs.ca),
                 TlsSettings(cert_file=certs.other_client_cert, key_file=certs.other_client_key, ca_file=certs.ca)]
    ports = [(a, "prefill") for a in users_cluster.prefill_addresses] + [
        (a, "decode") for a in users_cluster.decode_addresses]
    for address, role in ports:
        for tls in strangers:
            async with open_channel(address, tls) as channel:
                codes = {m: await call_with_empty_request(channel, m) for m in WORKER_API_METHODS[role]}
            assert set(codes.values()) == {grpc.StatusCode.UNAVAILABLE}, (address, tls, codes)
    for kv_address in users_cluster.prefill_addresses_kv:
        async with grpc.aio.insecure_channel(kv_address) as channel:
            codes = {m: await call_with_empty_request(channel, m) for m in KV_PORT_METHODS}
        assert set(codes.values()) == {grpc.StatusCode.UNAUTHENTICATED}, (kv_address, codes)


async def test_every_worker_is_in_the_registry_with_its_capacity(users_cluster, redis):
    watcher = RegistryWatcher(RegistrySettings(redis_url=redis.url, redis_password=redis.password), MESH_TOKEN)
    await watcher.start()
    try:
        records = {r.address: r for r in watcher.snapshot()}
    finally:
        await watcher.stop()
    assert set(records) == set(users_cluster.prefill_addresses + users_cluster.decode_addresses)
    assert sorted(r.kv_address for r in records.values() if r.role == "prefill") == sorted(
        users_cluster.prefill_addresses_kv)
    assert all(r.role == "decode" and r.kv_address == "" for a, r in records.items()
               if a in users_cluster.decode_addresses)
    assert all(r.num_kv_blocks > 0 and r.max_num_seqs == 64 and r.model == "tiny-llama" for r in records.values())


async def test_one_tenant_never_hits_another_tenants_prefix(users_cluster, gateway_tls):
    prompt = _random_prompt("tenant", 300)
    first_a = await _generate_grpc(users_cluster, prompt, KEY_A)
    await until_saved(users_cluster, gateway_tls)
    as_b = await _generate_grpc(users_cluster, prompt, KEY_B)
    await until_saved(users_cluster, gateway_tls)
    again_a = await _generate_grpc(users_cluster, prompt, KEY_A)
    assert first_a[0] == as_b[0] == again_a[0]
    full_blocks = 300 // BLOCK_SIZE * BLOCK_SIZE
    assert [r.usage.cached_prompt_tokens for _, r in (first_a, as_b, again_a)] == [0, 0, full_blocks]
    assert [r.transfer.prefill_computed_tokens for _, r in (first_a, as_b, again_a)] == [300, 300, 300 - full_blocks]


async def test_prefix_aware_routing_sends_a_request_to_the_worker_holding_its_prefix(
        users_cluster, tiny_llama_dir, redis, gateway_tls):
    index = PrefixIndex(redis.url, redis.password, mesh_token=MESH_TOKEN)
    try:
        for holder in (1, 0):   # cache a prefix on B, another on A; each request must follow its prefix
            address = users_cluster.prefill_addresses[holder]
            prefix = _random_prompt(f"route-{holder}", 256)
            async with in_process_gateway(users_cluster, tiny_llama_dir, prefill_workers=[address],
                                          worker_tls=gateway_tls) as only_holder:
                await generate(only_holder, make_request(prefix + [5] * 10, max_tokens=4))
            await until_indexed(index, users_cluster, gateway_tls, prefix + [7] * 10, 256 // BLOCK_SIZE)
            async with in_process_gateway(users_cluster, tiny_llama_dir, worker_tls=gateway_tls,
                                          route_policy="prefix_aware", kv_index_redis_url=redis.url,
                                          kv_index_redis_password=redis.password) as both:
                _, _, last = await generate(both, make_request(prefix + [7] * 10, max_tokens=4))
            assert last.transfer.prefill_worker == address
            assert (last.transfer.prefill_cached_tokens, last.transfer.prefill_computed_tokens) == (256, 10)
    finally:
        index.close()


async def test_client_cancel_frees_blocks_on_prefill_and_decode(users_cluster, gateway_tls):
    request = make_request(_random_prompt("cancel", 120), **LONG)
    async with grpc.aio.insecure_channel(users_cluster.gateway_address) as channel:
        call = generate_pb2_grpc.GenerationStub(channel).Generate(request, metadata=auth_metadata(KEY_A), timeout=60)
        async for chunk in call:
            if chunk.token_ids:
                break
        running = [s.num_running_requests for s in await stats_of(users_cluster.decode_addresses, gateway_tls)]
        assert sorted(running) == [0, 1]   # one decode is generating it
        call.cancel()
    await until_idle(users_cluster, gateway_tls)


async def test_cancel_during_prefill_frees_blocks_too(users_cluster, gateway_tls):
    request = make_request(_random_prompt("cancel-early", 2000), **LONG)
    async with grpc.aio.insecure_channel(users_cluster.gateway_address) as channel:
        call = generate_pb2_grpc.GenerationStub(channel).Generate(request, metadata=auth_metadata(KEY_A), timeout=60)
        await asyncio.sleep(0.05)
        call.cancel()
    await until_idle(users_cluster, gateway_tls)


async def test_deadline_is_honoured_and_frees_blocks(users_cluster, gateway_tls):
    async with grpc.aio.insecure_channel(users_cluster.gateway_address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in generate_pb2_grpc.GenerationStub(channel).Generate(
                    make_request(_random_prompt("deadline", 64), **LONG), metadata=auth_metadata(KEY_A), timeout=1.0):
                pass
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    await until_idle(users_cluster, gateway_tls)


async def test_admission_limit_answers_resource_exhausted_and_429(users_cluster, tiny_llama_dir, gateway_tls):
    async with in_process_gateway(users_cluster, tiny_llama_dir, worker_tls=gateway_tls, max_in_flight=1,
                                  http_port=0, with_gateway=True) as (gateway, address):
        async with grpc.aio.insecure_channel(address) as channel:
            stub = generate_pb2_grpc.GenerationStub(channel)
            busy = stub.Generate(make_request(_random_prompt("admission", 64), **LONG), timeout=60)
            async for _ in busy:
                break
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in stub.Generate(make_request("hi", max_tokens=2), timeout=30):
                    pass
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            client = openai.AsyncOpenAI(base_url=f"http://{gateway.http_address}/v1", api_key="none", max_retries=0)
            async with client:
                with pytest.raises(openai.RateLimitError) as http_err:
                    await client.completions.create(model="tiny-llama", prompt="hi", max_tokens=2)
            assert http_err.value.status_code == 429
            busy.cancel()
    await until_idle(users_cluster, gateway_tls)


async def test_decode_killed_mid_stream_continues_on_another_without_recomputing_the_prompt(
        users_cluster, tiny_llama_dir, reference, redis, gateway_tls):
    want = reference["runs"][7]["token_ids"][0]
    first_decode, other_decode = sorted(users_cluster.decode_addresses)  # round robin starts with the first
    async with in_process_gateway(users_cluster, tiny_llama_dir, worker_tls=gateway_tls,
                                  route_policy="round_robin") as address:
        await _connect_second_prefill_to_first(users_cluster, address, gateway_tls)
        token_ids, killed_after = [], None
        async for response in stream_generate(address, make_request(FAILOVER_PROMPT, **FAILOVER_SAMPLING)):
            token_ids += response.token_ids
            # killed once the prompt is in the first prefill's store (the retry's prefill reads it there)
            if killed_after is None and token_ids and await all_saved(users_cluster, gateway_tls):
                killed_after = len(token_ids)
                kill_worker(users_cluster, first_decode)
            last = response
    assert token_ids == want
    assert killed_after is not None and killed_after < len(want), "the stream ended before the kill"
    transfer = last.transfer
    assert (transfer.num_failovers, transfer.decode_worker) == (1, other_decode)
    assert killed_after <= transfer.resumed_at_token < len(want)
    # The resumed prefill found the prompt's full blocks cached: it computed only the partial block
    # and the tokens generated before the crash.
    assert transfer.prefill_computed_tokens == len(FAILOVER_PROMPT) + (
        len(FAILOVER_PROMPT) % BLOCK_SIZE + transfer.resumed_at_token)
    await until_left_registry(redis, first_decode, other_decode, gateway_tls)


async def test_prefill_killed_before_the_first_token_is_retried_invisibly(
        users_cluster, tiny_llama_dir, reference, gateway_tls):
    want = reference["runs"][5]["token_ids"][0]
    victim = sorted(users_cluster.prefill_addresses)[1]   # round robin's second pick
    async with in_process_gateway(users_cluster, tiny_llama_dir, worker_tls=gateway_tls, route_policy="round_robin",
                                  decode_workers=[a for a in users_cluster.decode_addresses
                                                  if a not in users_cluster.killed]) as address:
        await generate(address, make_request("warm up", max_tokens=2))  # on the first; learns both prefills
        kill_worker(users_cluster, victim)
        token_ids, _, last = await generate(address, make_request(USER_TEXT_PROMPTS[0], max_tokens=MAX_TOKENS))
    assert token_ids == want
    assert (last.transfer.num_failovers, last.transfer.resumed_at_token) == (1, 0)
    assert last.transfer.prefill_worker != victim


# ---- helpers ----

async def _generate_grpc(cluster, prompt: list[int], api_key: str):
    token_ids, _, last = await generate(cluster.gateway_address, make_request(prompt, max_tokens=8), api_key=api_key)
    return token_ids, last



async def _connect_second_prefill_to_first(cluster: LocalCluster, address: str, tls: TlsSettings) -> None:
    """Two requests of one prompt through a fresh round-robin gateway: the second prefill loads the
    prompt from the first's store, so the retry after a crash (the next two requests go the same two
    ways) finds its link to that store made. Once in CI, the retry's first connection between two
    engines spinning on one core outlasted the 10 s fetch deadline, and it recomputed the prompt."""
    prompt = _random_prompt("connect-prefills", 3 * BLOCK_SIZE + 1)
    for _ in range(2):
        async for _ in stream_generate(address, make_request(prompt, max_tokens=2)):
            pass
        await until_saved(cluster, tls)










"""The layer-wise KV flow's abort paths, on a real cluster (2 prefill and 2 decode workers, shared
memory): decode reserves its blocks before prefill starts and reads each layer as it is written,
so every failure finds both sides mid-way. The client cancelling, a prefill stopped past decode's
timeout, a prefill SIGKILLed mid-prefill and a decode SIGKILLed mid-read: the client gets the
monolithic tokens (or its cancellation), and no worker is left with a reservation, a pinned
transfer or a block in use. Layer-wise Prefill and Decode calls fuzzed (bounded: a Decode whose
KV never comes waits for decode's timeout), and a replayed transfer id refused. The kill tests run
last: the module keeps its cluster."""

from __future__ import annotations

import asyncio
import secrets
import signal
import time
import uuid

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdmesh.client import generate, make_request
from pdmesh.cluster import LocalCluster
from pdmesh.v1 import generate_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.e2e.conftest import (HOLD_TIMEOUT_S, MAX_TOKENS, in_process_gateway, kill_prompts, mesh_channel,
                                settled_stats, sync_mesh_channel, worker_stats)
from tests.e2e.fuzzing import (FUZZ, PROMPTS, SMALL_SAMPLING, TRANSFER_IDS, decode_runs_or_is_refused, kv_handles,
                               peer_compats, prefill_runs_or_is_refused)

pytestmark = pytest.mark.vllm
SLOW_STEP_S = 1.0    # each prefill step of a "slow-" request: 2 steps of 256 tokens for these prompts
PULL_TIMEOUT_S = 4.0  # decode gives a transfer up after this long without progress
# A layer-wise Decode whose transfer never comes waits PULL_TIMEOUT_S: a sixth of FUZZ's examples, at least 10
LAYERWISE_FUZZ = settings(FUZZ, max_examples=max(10, FUZZ.max_examples // 6))
MINTED_IDS = [secrets.token_urlsafe(18) for _ in range(3)]   # fuzzed requests reuse these: replays
WORKER_ARGS = ["--hold_timeout_s", str(HOLD_TIMEOUT_S), "--pull_timeout_s", str(PULL_TIMEOUT_S),
               "--kv_faults.slow_prefill_request_prefix", "slow-", "--kv_faults.slow_step_s", str(SLOW_STEP_S)]


@pytest.fixture(scope="module")
def layerwise_cluster(tiny_llama_dir, reference, tmp_path_factory):
    with LocalCluster(tiny_llama_dir, tmp_path_factory.mktemp("layerwise-cluster"), num_prefill=2, num_decode=2,
                      worker_args=WORKER_ARGS, prefill_args=["--engine.max_num_batched_tokens", "256"],
                      gateway_args=["--kv_flow", "layerwise"]) as running:
        running.killed = []
        yield running
        for address in _live(running):   # leak check: nothing pinned, reserved or in use
            stats = asyncio.run(settled_stats(address))
            assert (stats.num_held_transfers, stats.num_expired_transfers, stats.num_running_requests,
                    stats.num_waiting_requests, stats.kv_cache_usage) == (0, 0, 0, 0, 0.0), address


async def test_layerwise_tokens_equal_monolithic(layerwise_cluster, reference):
    want = reference["runs"][12]["token_ids"]
    for i, prompt in enumerate(kill_prompts("layerwise")):
        token_ids, _, last = await generate(layerwise_cluster.gateway_address,
                                            make_request(prompt, max_tokens=MAX_TOKENS, request_id=f"plain-{i}"))
        assert token_ids == want[i]
        transfer = last.transfer
        assert transfer.layerwise and transfer.num_blocks > 0
        # prefill's figures reach the last message though decode may finish before prefill answers
        assert transfer.prefill_computed_tokens + transfer.prefill_cached_tokens == len(prompt)
        assert transfer.prefill_computed_tokens > 0 and transfer.prefill_seconds > 0


async def test_a_layerwise_transfer_id_used_before_is_refused_by_prefill(layerwise_cluster):
    """A replay would publish a second request's KV under a transfer the first one holds, and the
    first's blocks would never be freed."""
    transfer_id = secrets.token_urlsafe(18)
    async with mesh_channel(layerwise_cluster.prefill_addresses[0]) as channel:
        stub = worker_pb2_grpc.PrefillStub(channel)
        requests = [worker_pb2.PrefillRequest(request_id=f"replay-{n}", prompt_token_ids=_fresh_prompt(7)[:40],
                                              layerwise_transfer_id=transfer_id) for n in range(2)]
        first = await stub.Prefill(requests[0], timeout=60)
        try:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.Prefill(requests[1], timeout=60)
        finally:
            await stub.Release(worker_pb2.ReleaseKVRequest(transfer_id=first.kv.transfer_id), timeout=10)
    assert first.kv.transfer_id == transfer_id
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "already used" in refused.value.details()
    await _idle(layerwise_cluster)


def test_fuzzed_layerwise_prefill_requests_run_once_per_transfer_id_or_are_refused(layerwise_cluster):
    accepted: list[str] = []
    with sync_mesh_channel(layerwise_cluster.prefill_addresses[0]) as channel:
        stub = worker_pb2_grpc.PrefillStub(channel)

        @LAYERWISE_FUZZ
        @given(tokens=PROMPTS, transfer_id=st.one_of(TRANSFER_IDS, st.sampled_from(MINTED_IDS)))
        def check(tokens, transfer_id):
            request = worker_pb2.PrefillRequest(request_id=f"fuzz-{uuid.uuid4().hex}", prompt_token_ids=tokens,
                                                layerwise_transfer_id=transfer_id)
            if prefill_runs_or_is_refused(stub, request, "Prefill (layer-wise)") and transfer_id:   # "": not layer-wise
                assert transfer_id not in accepted, "a transfer id was published twice"
                accepted.append(transfer_id)

        check()
    asyncio.run(_idle(layerwise_cluster))


def test_fuzzed_layerwise_decode_requests_stream_or_are_refused(layerwise_cluster):
    """Decode reserves blocks for a layer-wise handle and waits for KV that, here, no prefill
    computes: it gives the reservation up after its timeout and computes the prompt, or refuses the
    handle. Nothing stays reserved."""
    cluster = layerwise_cluster
    handles = kv_handles(cluster.prefill_addresses_kv[0], peer_compats(cluster.prefill_addresses[0]),
                         transfer_ids=st.one_of(TRANSFER_IDS, st.sampled_from(MINTED_IDS)), layerwise=True)
    with sync_mesh_channel(cluster.decode_addresses[0]) as channel:
        stub = worker_pb2_grpc.DecodeStub(channel)

        @LAYERWISE_FUZZ
        @given(tokens=PROMPTS, sampling=SMALL_SAMPLING, kv=handles)
        def check(tokens, sampling, kv):
            decode_runs_or_is_refused(stub, tokens, sampling, kv, "Decode (layer-wise)")

        check()
    asyncio.run(_idle(cluster))


async def test_decode_waits_for_layerwise_kv_without_stepping_its_workers(layerwise_cluster):
    """While its request waits for KV that a slowed prefill computes (two steps of SLOW_STEP_S),
    decode's engine goes to its model workers only at the request's start and end and every 0.1 s
    (vLLM would every millisecond: about 2,000 round trips)."""
    cluster = layerwise_cluster
    before = await asyncio.gather(*(worker_stats(a) for a in cluster.decode_addresses))
    started = time.monotonic()
    token_ids, _, last = await generate(cluster.gateway_address,
                                        make_request(_fresh_prompt(3), max_tokens=MAX_TOKENS, request_id="slow-quiet"))
    waited = time.monotonic() - started
    after = await asyncio.gather(*(worker_stats(a) for a in cluster.decode_addresses))
    worker_steps = sum(a.engine_worker_steps - b.engine_worker_steps for a, b in zip(after, before))
    quiet_steps = sum(a.engine_quiet_steps - b.engine_quiet_steps for a, b in zip(after, before))
    assert len(token_ids) == MAX_TOKENS and last.transfer.layerwise and last.transfer.num_blocks > 0
    assert waited > 2 * SLOW_STEP_S
    assert worker_steps < 15 * waited + MAX_TOKENS + 10, (worker_steps, quiet_steps)
    assert quiet_steps > 200 * waited, (worker_steps, quiet_steps)


async def test_client_cancelling_mid_prefill_frees_both_sides(layerwise_cluster, tiny_llama_dir):
    cluster = layerwise_cluster
    request = make_request(_fresh_prompt(1), max_tokens=MAX_TOKENS, request_id="slow-cancelled")
    async with in_process_gateway(cluster, tiny_llama_dir, with_gateway=True, kv_flow="layerwise") as (gateway,
                                                                                                      address):
        async with grpc.aio.insecure_channel(address) as channel:
            call = generate_pb2_grpc.GenerationStub(channel).Generate(request, timeout=60)
            await _mid_prefill(gateway)
            call.cancel()
    await _idle(cluster)


async def test_prefill_stopped_past_the_decode_timeout_leaves_decode_computing_the_right_tokens(
        layerwise_cluster, reference, tiny_llama_dir):
    """SIGSTOP: the prefill's RPC neither answers nor fails. Decode gives the reservation up after
    its timeout and computes the prompt itself; once the prefill is back (SIGCONT) its request,
    cancelled meanwhile, frees everything."""
    cluster = layerwise_cluster
    want = reference["runs"][12]["token_ids"][0]
    request = make_request(kill_prompts("layerwise")[0], max_tokens=MAX_TOKENS, request_id="slow-stopped")
    async with in_process_gateway(cluster, tiny_llama_dir, with_gateway=True, kv_flow="layerwise") as (gateway,
                                                                                                      address):
        failed_before = await _failed_blocks(cluster.decode_addresses)
        running = asyncio.create_task(generate(address, request))
        victim = await _mid_prefill(gateway)
        cluster.signal(cluster.worker_names[victim], signal.SIGSTOP)
        stopped_at = time.monotonic()
        try:
            token_ids, _, last = await running
            waited = time.monotonic() - stopped_at
        finally:
            cluster.signal(cluster.worker_names[victim], signal.SIGCONT)
    assert token_ids == want
    assert PULL_TIMEOUT_S - 1 < waited < PULL_TIMEOUT_S + 20
    assert await _failed_blocks(cluster.decode_addresses) > failed_before  # given up, computed on decode
    assert last.transfer.num_failovers == 0
    await _idle(cluster)


async def test_prefill_killed_mid_prefill_is_retried_on_the_other_prefill(
        layerwise_cluster, reference, tiny_llama_dir):
    cluster = layerwise_cluster
    want = reference["runs"][12]["token_ids"][1]
    request = make_request(kill_prompts("layerwise")[1], max_tokens=MAX_TOKENS, request_id="slow-prefill-killed")
    token_ids, last, victim = await _generate_killing(cluster, tiny_llama_dir, request, _mid_prefill)
    assert token_ids == want
    assert (last.transfer.num_failovers, last.transfer.layerwise) == (1, True)
    assert last.transfer.prefill_worker != victim
    await _idle(cluster)


async def test_decode_killed_mid_read_is_retried_and_the_prefill_frees_its_blocks(
        layerwise_cluster, reference, tiny_llama_dir):
    cluster = layerwise_cluster
    want = reference["runs"][12]["token_ids"][0]
    request = make_request(kill_prompts("layerwise")[0], max_tokens=MAX_TOKENS, request_id="slow-decode-killed")

    async def decode_mid_read(gateway) -> str:
        await _mid_prefill(gateway)
        return await _in_flight(gateway, "decode")

    token_ids, last, victim = await _generate_killing(cluster, tiny_llama_dir, request, decode_mid_read,
                                                      prefill_workers=_live(cluster, "prefill"))
    assert token_ids == want
    assert last.transfer.num_failovers == 1 and last.transfer.decode_worker != victim
    await _idle(cluster)


# ---- helpers ----

def _fresh_prompt(seed: int) -> list[int]:
    return [0] + [(i * 7 + seed * 131) % 1000 + 3 for i in range(499)]


def _live(cluster: LocalCluster, role: str = "") -> list[str]:
    addresses = {"prefill": cluster.prefill_addresses, "decode": cluster.decode_addresses}.get(
        role, cluster.prefill_addresses + cluster.decode_addresses)
    return [address for address in addresses if address not in cluster.killed]


def _kill(cluster: LocalCluster, address: str) -> None:
    cluster.kill(cluster.worker_names[address])
    cluster.killed.append(address)


async def _generate_killing(cluster: LocalCluster, tokenizer_dir, request, victim_of, **gateway_settings):
    """(token ids, last response, victim): the request through a layer-wise gateway, the worker that
    `victim_of(gateway)` names SIGKILLed while it runs."""
    async with in_process_gateway(cluster, tokenizer_dir, with_gateway=True, kv_flow="layerwise",
                                  **gateway_settings) as (gateway, address):
        running = asyncio.create_task(generate(address, request))
        victim = await victim_of(gateway)
        _kill(cluster, victim)
        token_ids, _, last = await running
    return token_ids, last, victim


async def _until(condition, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await condition():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.05)


async def _in_flight(gateway, role: str) -> str:
    async def found():
        return any(worker.in_flight for worker in gateway.pool.workers(role))
    await _until(found, f"no {role} call in flight")
    (address,) = [worker.address for worker in gateway.pool.workers(role) if worker.in_flight]
    return address


async def _mid_prefill(gateway) -> str:
    """The prefill worker of the request in flight, half-way through its first (slowed) step: decode
    holds its reservation meanwhile. (Its engine answers no stats while a slowed step runs.)"""
    await _in_flight(gateway, "decode")
    address = await _in_flight(gateway, "prefill")
    await asyncio.sleep(SLOW_STEP_S / 2)
    return address


async def _failed_blocks(addresses: list[str]) -> int:
    live = await asyncio.gather(*(worker_stats(a) for a in addresses))
    return sum(s.kv_failed_blocks for s in live)


async def _idle(cluster: LocalCluster, timeout_s: float = 15.0) -> None:
    """Nothing running, waiting, pinned or in use on any live worker (none expired: all freed on purpose)."""
    async def idle():
        stats = await asyncio.gather(*(worker_stats(a) for a in _live(cluster)))
        return all((s.num_running_requests, s.num_waiting_requests, s.num_held_transfers, s.num_expired_transfers,
                    s.kv_cache_usage) == (0, 0, 0, 0, 0.0) for s in stats)
    await _until(idle, "a worker still holds blocks after the request ended", timeout_s)

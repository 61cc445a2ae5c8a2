"""Bad input and broken handoffs: clear status codes, correct output, workers keep serving."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdmesh.client import generate, make_request
from pdmesh.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from tests.e2e.conftest import (ABANDONED_TRANSFERS, HOLD_TIMEOUT_S, LOST_KV_PROMPT, MAX_TOKENS, mesh_channel,
                                token_prompts, worker_stats)

pytestmark = pytest.mark.vllm


async def _health(address: str) -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        response = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""))
    return response.status


@pytest.mark.parametrize("prompt, kwargs, code", [
    ("", {}, grpc.StatusCode.INVALID_ARGUMENT),
    ([7] * 4096, {}, grpc.StatusCode.INVALID_ARGUMENT),
    ("hello", {"max_tokens": 0}, grpc.StatusCode.INVALID_ARGUMENT),
    ("hello", {"model": "no-such-model"}, grpc.StatusCode.NOT_FOUND),
])
async def test_invalid_request_gets_its_status_and_workers_stay_healthy(cluster, reference, prompt, kwargs, code):
    model = kwargs.pop("model", "")
    request = make_request(prompt, **{"max_tokens": 4, **kwargs})
    request.model = model
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await generate(cluster.gateway_address, request)
    assert info.value.code() == code
    for address in cluster.prefill_addresses + cluster.decode_addresses:
        assert await _health(address) == health_pb2.HealthCheckResponse.SERVING
    token_ids, _, _ = await generate(cluster.gateway_address, make_request(token_prompts()[5], max_tokens=MAX_TOKENS))
    assert token_ids == reference["runs"][0]["token_ids"][5]


@pytest.mark.parametrize("request_fields, message", [
    ({"prompt_token_ids": [0, 99999]}, "outside the vocabulary"),
    # Sampling vLLM's SamplingParams refuses (found by the fuzz): a client error, not INTERNAL from the engine.
    ({"prompt_token_ids": [0, 5], "sampling": common_pb2.SamplingParams(max_tokens=1, top_p=2.0)}, "top_p"),
    ({"prompt_token_ids": [0, 5], "sampling": common_pb2.SamplingParams(max_tokens=1, stop=[""])}, "empty string"),
])
async def test_workers_reject_bad_requests_sent_to_them_directly(cluster, request_fields, message):
    async with mesh_channel(cluster.prefill_addresses[0]) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await worker_pb2_grpc.PrefillStub(channel).Prefill(
                worker_pb2.PrefillRequest(request_id="bad-1", **request_fields))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in info.value.details()


async def test_decode_refuses_kv_from_an_incompatible_producer(cluster):
    async with mesh_channel(cluster.decode_addresses[0]) as channel:
        info = await worker_pb2_grpc.WorkerInfoStub(channel).GetInfo(worker_pb2.GetInfoRequest())
        compat = common_pb2.CompatInfo()
        compat.CopyFrom(info.compat)
        compat.block_size = 64
        request = worker_pb2.DecodeRequest(
            request_id="incompat-1", prompt_token_ids=[0, 5, 6], sampling=common_pb2.SamplingParams(max_tokens=2),
            kv=common_pb2.KVHandle(transfer_id="x", kv_address="127.0.0.1:1", block_ids=[0], num_tokens=3,
                                   compat=compat))
        with pytest.raises(grpc.aio.AioRpcError) as error:
            async for _ in worker_pb2_grpc.DecodeStub(channel).Decode(request):
                pass
    assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "block_size: prefill=64 decode=32" in error.value.details()


async def test_decode_refuses_a_handle_whose_ranks_disagree_with_its_compat(cluster):
    """The handle's producer ranks decide which ports decode reads: they must be the compat's."""
    async with mesh_channel(cluster.decode_addresses[0]) as channel:
        info = await worker_pb2_grpc.WorkerInfoStub(channel).GetInfo(worker_pb2.GetInfoRequest())
        request = worker_pb2.DecodeRequest(
            request_id="ranks-1", prompt_token_ids=[0, 5, 6], sampling=common_pb2.SamplingParams(max_tokens=2),
            kv=common_pb2.KVHandle(transfer_id="x", kv_address="127.0.0.1:1", block_ids=[0], num_tokens=3,
                                   compat=info.compat, tp_size=2))
        with pytest.raises(grpc.aio.AioRpcError) as error:
            async for _ in worker_pb2_grpc.DecodeStub(channel).Decode(request):
                pass
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "2 producer ranks, its compat 1" in error.value.details()


async def test_lost_kv_is_recomputed_on_decode_and_output_stays_correct(cluster, reference):
    """A handle naming a transfer the producer never held: the pull fails, vLLM recomputes."""
    prompt, want = LOST_KV_PROMPT, reference["runs"][3]["token_ids"][0]  # sent by no other test
    before = await worker_stats(cluster.decode_addresses[0])
    async with mesh_channel(cluster.decode_addresses[0]) as channel:
        info = await worker_pb2_grpc.WorkerInfoStub(channel).GetInfo(worker_pb2.GetInfoRequest())
        request = worker_pb2.DecodeRequest(
            request_id="lost-1", prompt_token_ids=prompt,
            sampling=common_pb2.SamplingParams(max_tokens=len(want)),
            kv=common_pb2.KVHandle(transfer_id="never-held", kv_address=cluster.prefill_addresses_kv[0],
                                   block_ids=[1, 2, 3, 4], num_tokens=len(prompt), compat=info.compat))
        token_ids = []
        async for chunk in worker_pb2_grpc.DecodeStub(channel).Decode(request):
            token_ids.extend(chunk.token_ids)
            last = chunk
    assert token_ids == want
    assert (last.kv_blocks_received, last.num_cached_tokens) == (0, 0)  # every prompt token recomputed
    after = await worker_stats(cluster.decode_addresses[0])
    assert after.kv_failed_blocks - before.kv_failed_blocks == 4



async def test_kv_no_decode_ever_pulls_is_freed_at_the_hold_deadline(cluster):
    before = await worker_stats(cluster.prefill_addresses[0])
    async with mesh_channel(cluster.prefill_addresses[0]) as channel:
        response = await worker_pb2_grpc.PrefillStub(channel).Prefill(
            worker_pb2.PrefillRequest(request_id="abandoned-1", prompt_token_ids=[0] + list(range(700, 740))))
    assert len(response.kv.block_ids) == 2
    ABANDONED_TRANSFERS.append("abandoned-1")
    await asyncio.sleep(1.0)
    assert (await worker_stats(cluster.prefill_addresses[0])).num_held_transfers == before.num_held_transfers + 1
    await asyncio.sleep(HOLD_TIMEOUT_S + 1.0)
    after = await worker_stats(cluster.prefill_addresses[0])
    assert after.num_held_transfers == before.num_held_transfers
    assert after.num_expired_transfers == before.num_expired_transfers + 1

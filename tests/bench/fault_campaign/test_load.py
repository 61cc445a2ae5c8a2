"""The campaign's load keeps each request's route from the gateway's last message (which workers it
ran on, whether it failed over, what it read from another node's store): how a trial knows the
requests on its victim. A real grpc.aio server on loopback answers as the gateway would."""

from __future__ import annotations

import asyncio

import grpc

from bench.fault_campaign.load import StreamLoad, Workload
from bench.fault_campaign.outcomes import Outcome
from pdmesh.v1 import common_pb2, generate_pb2, generate_pb2_grpc

ROUTE = generate_pb2.TransferStats(prefill_worker="127.0.0.1:6001", decode_worker="127.0.0.1:6003", num_failovers=1,
                                   prefill_cached_tokens=64, prefill_store_tokens={"remote": 64, "dram": 32})
WORKLOAD = Workload(prompts=[[1, 2, 3]], expected=[[5, 6]], max_tokens=2)


class FakeGateway(generate_pb2_grpc.GenerationServicer):
    def __init__(self, fail: bool) -> None:
        self._fail = fail

    async def Generate(self, request, context):
        await asyncio.sleep(0.01)
        yield generate_pb2.GenerateResponse(token_ids=[5])
        if self._fail:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "decode worker 127.0.0.1:6003 failed: gone")
        yield generate_pb2.GenerateResponse(token_ids=[6], finish_reason=common_pb2.FINISH_REASON_LENGTH,
                                            transfer=ROUTE)


async def _load_on(gateway: FakeGateway) -> list:
    server = grpc.aio.server()
    generate_pb2_grpc.add_GenerationServicer_to_server(gateway, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with StreamLoad(f"127.0.0.1:{port}", WORKLOAD, num_streams=1) as load:
            await asyncio.sleep(0.1)
    finally:
        await server.stop(None)
    await asyncio.sleep(0)
    assert asyncio.all_tasks() == {asyncio.current_task()}   # the load's streams ended with it
    return load.results


async def test_a_completed_request_keeps_the_gateways_route_and_the_tokens_it_read_from_another_store():
    results = await _load_on(FakeGateway(fail=False))
    assert results
    for result in results:
        assert (result.outcome, result.prefill_worker, result.decode_worker) == (
            Outcome.COMPLETED, "127.0.0.1:6001", "127.0.0.1:6003")
        assert (result.num_failovers, result.remote_store_tokens, result.prefill_cached_tokens) == (1, 64, 64)


async def test_a_failed_request_has_no_route_and_its_error_names_the_worker():
    results = await _load_on(FakeGateway(fail=True))
    assert results
    for result in results:
        assert (result.outcome, result.prefill_worker, result.decode_worker, result.num_failovers) == (
            Outcome.FAILED_CLEAR, "", "", 0)
        assert result.detail == "UNAVAILABLE: decode worker 127.0.0.1:6003 failed: gone"

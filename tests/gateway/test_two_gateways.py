"""Two gateway replicas in front of the same workers place alike: they read the same load, prompt
rates and decoding step times from the registry (a real redis-server; in-process stand-in workers
taking both roles)."""

from __future__ import annotations

from gateway.server import Gateway
from pdmesh.client import generate, make_request
from pdmesh.config import GatewaySettings
from pdmesh.registry import RegistryPublisher, WorkerLoad
from pdmesh.v1 import generate_pb2
from tests.gateway.fake_workers import FakeWorker
from tests.gateway.test_redis_forgery import TOKEN, _record, _registry

LONG_PROMPT = list(range(3, 103))   # 100 tokens: its compute harms the streams of the worker computing it


def _computed_on(last) -> str:
    return last.transfer.decode_worker if last.transfer.local_prefill else last.transfer.prefill_worker


async def _mesh(redis_server, tiny_llama_dir, loads_of):
    """Two both-role stand-in workers publishing loads_of(addresses)[address], two gateways."""
    workers = [FakeWorker("both"), FakeWorker("both")]
    addresses = [await w.server.start("127.0.0.1", 0) for w in workers]
    loads = loads_of(addresses)
    publishers = [RegistryPublisher(_registry(redis_server), _record("both", a, w.kv_address), lambda a=a: loads[a],
                                    mesh_token=TOKEN) for a, w in zip(addresses, workers)]
    gateways = [Gateway(GatewaySettings(port=0, tokenizer=str(tiny_llama_dir), registry=_registry(redis_server),
                                        disagg_policy="adaptive", mesh_token=TOKEN)) for _ in range(2)]
    for publisher in publishers:
        await publisher.start()
    return workers, addresses, loads, publishers, gateways, [await g.start() for g in gateways]


async def _stop(workers, publishers, gateways) -> None:
    for gateway in gateways:
        await gateway.stop(0)
    for publisher in publishers:
        await publisher.stop()
    for worker in workers:
        await worker.server.stop(0)


async def test_two_gateways_compute_a_long_prompt_on_the_same_worker_and_follow_a_load_shift(redis_server,
                                                                                           tiny_llama_dir):
    workers, addresses, loads, publishers, gateways, gateway_addresses = await _mesh(
        redis_server, tiny_llama_dir,
        lambda addresses: {a: WorkerLoad(num_running=8 * (i == 0), prefill_tokens_per_s=1_000.0)
                           for i, a in enumerate(addresses)})
    try:
        for busy, idle in (addresses, reversed(addresses)):
            chosen = {_computed_on((await generate(g, make_request(LONG_PROMPT, max_tokens=2)))[2])
                      for g in gateway_addresses}
            assert chosen == {idle}
            loads[busy], loads[idle] = loads[idle], loads[busy]   # the load moves over
            for publisher in publishers:
                await publisher.beat()
            for gateway in gateways:
                await gateway.registry.refresh()
    finally:
        await _stop(workers, publishers, gateways)


async def test_two_gateways_read_a_workers_tpot_from_its_own_figure_whoever_runs_its_streams(redis_server,
                                                                                           tiny_llama_dir):
    """Neither gateway has a stream anywhere; the first worker runs 1 stream (of another gateway) at
    50 ms steps, the second 3 at 10 ms: a request asking for 25 ms is decoded on the second by both
    gateways (its prompt computed on the first, with fewer streams to harm); one asking for no TPOT
    is served whole on the first."""
    workers, addresses, loads, publishers, gateways, gateway_addresses = await _mesh(
        redis_server, tiny_llama_dir,
        lambda addresses: {addresses[0]: WorkerLoad(num_running=1, prefill_tokens_per_s=10_000.0, decode_step_s=0.05),
                           addresses[1]: WorkerLoad(num_running=3, prefill_tokens_per_s=10_000.0, decode_step_s=0.01)})
    try:
        for tpot_s, placed in ((0.025, (False, addresses[0], addresses[1])), (0.0, (True, "", addresses[0]))):
            request = make_request(LONG_PROMPT[:40], max_tokens=2)
            request.slo.CopyFrom(generate_pb2.Slo(tpot_s=tpot_s))
            lasts = [(await generate(g, request))[2] for g in gateway_addresses]
            assert {(t.local_prefill, t.prefill_worker if not t.local_prefill else "", t.decode_worker)
                    for t in (last.transfer for last in lasts)} == {placed}
    finally:
        await _stop(workers, publishers, gateways)

"""Two gateway replicas in front of the same workers place alike: they read the same load and prompt
rates from the registry (a real redis-server; in-process stand-in workers taking both roles)."""

from __future__ import annotations

from gateway.server import Gateway
from pdmesh.client import generate, make_request
from pdmesh.config import GatewaySettings
from pdmesh.registry import RegistryPublisher, WorkerLoad
from tests.gateway.fake_workers import FakeWorker
from tests.gateway.test_redis_forgery import TOKEN, _record, _registry

LONG_PROMPT = list(range(3, 103))   # 100 tokens: its compute harms the streams of the worker computing it


def _computed_on(last) -> str:
    return last.transfer.decode_worker if last.transfer.local_prefill else last.transfer.prefill_worker


async def test_two_gateways_compute_a_long_prompt_on_the_same_worker_and_follow_a_load_shift(redis_server,
                                                                                           tiny_llama_dir):
    workers = [FakeWorker("both"), FakeWorker("both")]
    addresses = [await w.server.start("127.0.0.1", 0) for w in workers]
    loads = {a: WorkerLoad(num_running=8 * (i == 0), prefill_tokens_per_s=1_000.0) for i, a in enumerate(addresses)}
    publishers = [RegistryPublisher(_registry(redis_server), _record("both", a, w.kv_address), lambda a=a: loads[a],
                                    mesh_token=TOKEN) for a, w in zip(addresses, workers)]
    gateways = [Gateway(GatewaySettings(port=0, tokenizer=str(tiny_llama_dir), registry=_registry(redis_server),
                                        disagg_policy="adaptive", mesh_token=TOKEN)) for _ in range(2)]
    try:
        for publisher in publishers:
            await publisher.start()
        gateway_addresses = [await g.start() for g in gateways]
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
        for gateway in gateways:
            await gateway.stop(0)
        for publisher in publishers:
            await publisher.stop()
        for worker in workers:
            await worker.server.stop(0)

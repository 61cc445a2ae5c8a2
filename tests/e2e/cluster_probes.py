"""Probes of a running cluster's workers for the e2e tests: their stats, waits until they are
idle or saved, a worker's exit from the registry and the index."""

from __future__ import annotations

import asyncio

import grpc

from gateway.pool import WorkerPool
from gateway.prefix_index import PrefixIndex
from gateway.prompt_names import PromptNames
from pdmesh.cluster import LocalCluster
from pdmesh.config import RegistrySettings, TlsSettings
from pdmesh.registry import RegistryWatcher
from pdmesh.v1 import generate_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.conftest import MESH_TOKEN
from tests.e2e.conftest import mesh_channel, worker_stats
from tests.redis_server import RedisServer


async def stream_generate(address: str, request):
    async with grpc.aio.insecure_channel(address) as channel:
        async for response in generate_pb2_grpc.GenerationStub(channel).Generate(request, timeout=120):
            yield response


def kill_worker(cluster: LocalCluster, address: str) -> None:
    cluster.kill(cluster.worker_names[address])
    cluster.killed.append(address)


async def stats_of(addresses: list[str], tls: TlsSettings) -> list[worker_pb2.WorkerStats]:
    return list(await asyncio.gather(*(worker_stats(a, tls) for a in addresses)))


async def live_stats(cluster, tls: TlsSettings) -> list[worker_pb2.WorkerStats]:
    return await stats_of([a for a in cluster.prefill_addresses + cluster.decode_addresses if a not in cluster.killed],
                        tls)


async def until(condition, what: str, timeout_s: float = 15.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await condition():
        assert asyncio.get_running_loop().time() < deadline, what
        await asyncio.sleep(0.1)


async def all_saved(cluster, tls: TlsSettings) -> bool:
    """Nothing pinned and no save queued or being written: every prompt is in a store and its index."""
    return all((s.num_held_transfers, s.kv_store_saves_pending) == (0, 0) for s in await live_stats(cluster, tls))


async def until_saved(cluster, tls: TlsSettings) -> None:
    await until(lambda: all_saved(cluster, tls), "KV still pinned")


async def until_idle(cluster, tls: TlsSettings) -> None:
    """No request running or waiting, no transfer pinned, no KV block in use, on every live worker."""
    async def idle():
        return all((s.num_running_requests, s.num_waiting_requests, s.num_held_transfers, s.kv_cache_usage)
                   == (0, 0, 0, 0.0) for s in await live_stats(cluster, tls))
    await until(idle, "blocks still in use after the request ended")


async def until_indexed(index: PrefixIndex, cluster, tls: TlsSettings, prompt: list[int], num_blocks: int) -> None:
    async with mesh_channel(cluster.prefill_addresses[0], tls) as channel:
        info = await worker_pb2_grpc.WorkerInfoStub(channel).GetInfo(worker_pb2.GetInfoRequest(), timeout=10)

    async def indexed():
        return len(await index.holders(info.compat, PromptNames(prompt))) >= num_blocks
    await until(indexed, "prefix never reached the index")


async def until_left_registry(redis: RedisServer, dead: str, alive: str, tls: TlsSettings) -> None:
    """A killed worker stops heartbeating: its record expires within the TTL (3 s) plus a poll, and
    a registry-fed pool (the gateway's) stops offering it."""
    watcher = RegistryWatcher(RegistrySettings(redis_url=redis.url, redis_password=redis.password, poll_s=0.2),
                              MESH_TOKEN)
    await watcher.start()
    pool = WorkerPool([], [], tls, registry=watcher, mesh_token=MESH_TOKEN)
    try:
        async def gone():
            return dead not in watcher.workers
        await until(gone, "dead worker still registered", timeout_s=6.0)
        assert [w.address for w in await pool.candidates("decode")] == [alive]
    finally:
        await watcher.stop()
        await pool.close()

"""Lifecycle shared by the prefill and decode worker processes: engine, gRPC server, shutdown."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from pdmesh.config import WorkerSettings
from pdmesh.engine import build_worker_engine, free_port
from pdmesh.grpc_server import AioServer, wait_for_termination_signal, write_ready_file
from pdmesh.v1 import common_pb2, worker_pb2, worker_pb2_grpc

logger = logging.getLogger(__name__)

AddServicer = Callable[[AioServer, object, worker_pb2.WorkerInfoResponse], None]


class WorkerInfoServicer(worker_pb2_grpc.WorkerInfoServicer):
    def __init__(self, info: worker_pb2.WorkerInfoResponse, engine) -> None:
        self._info = info
        self._engine = engine

    async def GetInfo(self, request, context):
        return self._info

    async def GetStats(self, request, context):
        counters = (await self._engine.collective_rpc("pdmesh_counters"))[0]
        return worker_pb2.WorkerStats(**counters)


async def describe_worker(settings: WorkerSettings, engine, kv_address: str) -> worker_pb2.WorkerInfoResponse:
    compat = common_pb2.CompatInfo.FromString((await engine.collective_rpc("pdmesh_compat"))[0])
    model_config = engine.model_config
    return worker_pb2.WorkerInfoResponse(
        role=settings.role, model=settings.engine.served_model_name,
        max_model_len=model_config.max_model_len, compat=compat,
        kv_address=kv_address if settings.role == "prefill" else "",
        vocab_size=model_config.get_vocab_size())


async def run_worker(settings: WorkerSettings, service_name: str, add_servicer: AddServicer) -> None:
    kv_port = settings.kv_port or free_port(settings.kv_host)
    engine = build_worker_engine(settings, kv_port)
    try:
        advertise_host = settings.kv_advertise_host or settings.kv_host
        info = await describe_worker(settings, engine, f"{advertise_host}:{kv_port}")
        server = AioServer([service_name, "pdmesh.v1.WorkerInfo"])
        worker_pb2_grpc.add_WorkerInfoServicer_to_server(WorkerInfoServicer(info, engine), server.server)
        add_servicer(server, engine, info)
        address = await server.start(settings.host, settings.port)
        logger.info("%s worker serving on %s (KV %s)", settings.role, address, info.kv_address or "-")
        write_ready_file(settings.ready_file, address=address, kv_address=info.kv_address, role=settings.role)
        await wait_for_termination_signal()
        await server.stop()
    finally:
        engine.shutdown()


def worker_main(role: str, service_name: str, add_servicer: AddServicer, argv: list[str] | None = None) -> None:
    """Entry point of `python -m prefill` / `python -m decode`."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    settings = WorkerSettings.from_cli(argv, role=role)
    asyncio.run(run_worker(settings, service_name, add_servicer))

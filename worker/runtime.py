"""Lifecycle shared by the prefill and decode worker processes: engine, gRPC server, shutdown."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import asdict

from pdmesh import engine_debris
from pdmesh.config import WorkerSettings
from pdmesh.errors import Incompatible
from pdmesh.gc_heap import freeze_startup_heap
from pdmesh.grpc_errors import maps_domain_errors
from pdmesh.grpc_server import AioServer, wait_for_termination_signal, write_ready_file
from pdmesh.telemetry.logs import configure_logging
from pdmesh.telemetry.metrics import MeshMetrics
from pdmesh.telemetry.tracing import setup_tracing, shutdown_tracing
from pdmesh.tls import server_credentials
from pdmesh.transport.affinity import pin_process
from pdmesh.transport.mesh_auth import AioMeshTokenInterceptor
from pdmesh.v1 import worker_pb2, worker_pb2_grpc
from worker.engine import build_worker_engine, free_port
from worker.registration import WorkerRegistration
from worker.vllm_ext.engine_calls import EngineCalls

logger = logging.getLogger(__name__)

AddServicer = Callable[[AioServer, object, worker_pb2.WorkerInfoResponse, MeshMetrics], None]


class WorkerInfoServicer(worker_pb2_grpc.WorkerInfoServicer):
    def __init__(self, info: worker_pb2.WorkerInfoResponse, engine) -> None:
        self._info = info
        self._calls = EngineCalls(engine)

    async def GetInfo(self, request, context):
        return self._info

    async def GetStats(self, request, context):
        counters = await self._calls.counters()
        counters.pop("kv_bytes_sent_by_transport", None)  # the metrics' transport label has it
        return worker_pb2.WorkerStats(**counters, **asdict(await self._calls.scheduler_stats()))

    @maps_domain_errors
    async def SpillKV(self, request, context):
        moved = await self._calls.spill_store(request.tier)
        if moved is None:
            raise Incompatible(f"this worker has no KV store tier {request.tier!r}")
        return worker_pb2.SpillKVResponse(num_blocks_moved=moved)


async def describe_worker(settings: WorkerSettings, engine, kv_address: str) -> worker_pb2.WorkerInfoResponse:
    compat = await EngineCalls(engine).compat()
    model_config = engine.model_config
    return worker_pb2.WorkerInfoResponse(
        role=settings.role, model=settings.engine.served_model_name,
        max_model_len=model_config.max_model_len, compat=compat,
        kv_address=kv_address if settings.produces else "",
        vocab_size=model_config.get_vocab_size())


async def _freeze_startup_heaps(engine) -> None:
    """The model workers' and this process's heaps out of garbage collection (pdmesh/gc_heap.py)."""
    for num_objects, collect_s in await EngineCalls(engine).freeze_gc():
        logger.info("model worker heap: %d objects frozen (a full collection took %.2f s)", num_objects, collect_s)
    own = freeze_startup_heap()
    logger.info("worker process heap: %d objects frozen (a full collection took %.2f s)", own.num_objects,
                own.collect_s)


async def run_worker(settings: WorkerSettings, service_names: list[str], add_servicer: AddServicer) -> None:
    from worker.engine_stats import ConnectorCounterSync, stat_logger_factory

    provider = setup_tracing(settings.telemetry, f"pdmesh-{settings.role}")
    metrics = MeshMetrics(settings.role)
    block_nbytes_holder: list[int] = []
    kv_port = settings.kv_port or free_port(settings.kv_host, settings.engine.tensor_parallel_size)
    pin_process(settings.process_cpus)  # before the engine's processes start: they inherit it
    engine_debris.sweep()  # what engines killed on this host left, before this one allocates
    engine = build_worker_engine(settings, kv_port, [stat_logger_factory(metrics, block_nbytes_holder)])
    sweep_after_death = asyncio.get_running_loop().create_task(engine_debris.sweep_after_death(lambda: engine.errored))
    try:
        info = await describe_worker(settings, engine, settings.kv_address_for_peers(kv_port))
        engine_debris.record_stores(await EngineCalls(engine).dist_stores())
        await _freeze_startup_heaps(engine)
        await asyncio.to_thread(engine_debris.sweep)  # what was younger than the grace a moment ago
        block_nbytes_holder.append(info.compat.block_nbytes)
        token_check = [AioMeshTokenInterceptor(settings.mesh_token)] if settings.mesh_token else []
        server = AioServer([*service_names, "pdmesh.v1.WorkerInfo"], interceptors=token_check)
        worker_pb2_grpc.add_WorkerInfoServicer_to_server(WorkerInfoServicer(info, engine), server.server)
        add_servicer(server, engine, info, metrics)
        metrics_address = _serve_metrics(settings, metrics)
        address = await server.start(settings.host, settings.port, credentials=server_credentials(settings.tls))
        registration = await _register(settings, engine, info, address)
        if metrics_address and settings.produces:  # only a producer's engine counts bytes sent
            ConnectorCounterSync(engine, metrics).attach(asyncio.get_running_loop())
        metrics.healthy.labels(settings.role).set(1)
        logger.info("%s worker serving on %s (KV %s, metrics %s)", settings.role, address, info.kv_address or "-",
                    metrics_address or "off")
        write_ready_file(settings.ready_file, address=address, kv_address=info.kv_address, role=settings.role,
                         metrics_address=metrics_address, kv_port=kv_port if settings.produces else 0)
        await wait_for_termination_signal(settings.exit_with_parent)
        metrics.healthy.labels(settings.role).set(0)
        if registration is not None:
            await registration.stop()
        await server.stop()
    finally:
        sweep_after_death.cancel()
        engine.shutdown()
        shutdown_tracing(provider)


async def _register(settings: WorkerSettings, engine, info: worker_pb2.WorkerInfoResponse,
                    address: str) -> WorkerRegistration | None:
    if not settings.registry.redis_url:
        return None
    port = address.rsplit(":", 1)[1]
    registration = WorkerRegistration(settings, engine, info, f"{settings.address_for_gateways}:{port}")
    await registration.start()
    return registration


def _serve_metrics(settings: WorkerSettings, metrics: MeshMetrics) -> str:
    telemetry = settings.telemetry
    return "" if telemetry.metrics_port is None else metrics.serve(telemetry.metrics_host, telemetry.metrics_port)


def missing_mesh_credential(settings: WorkerSettings) -> str | None:
    """Why this worker would serve callers it cannot tell from mesh peers (None: it would not)."""
    if settings.mesh_token or settings.insecure_no_mesh_auth:
        return None
    if settings.tls.ca_file is not None and settings.kv_tls.ca_file is not None:
        return None   # mTLS with client certificates on both ports
    return ("no mesh credential: set --mesh_token (PDMESH_WORKER_MESH_TOKEN, the same secret on every worker and "
            "gateway of the mesh), or mTLS with client certificates on both ports (--tls.* and --kv_tls.* with "
            "ca_file); --insecure_no_mesh_auth serves anyone who reaches the ports")


def worker_main(role: str, service_names: list[str], add_servicer: AddServicer, argv: list[str] | None = None) -> None:
    """Entry point of `python -m prefill` / `python -m decode` / `python -m node` (both roles)."""
    settings = WorkerSettings.from_cli(argv, role=role)
    configure_logging(settings.telemetry.log_format)
    problem = missing_mesh_credential(settings)
    if problem is not None:
        raise SystemExit(f"pdmesh {role} worker: {problem}")
    asyncio.run(run_worker(settings, service_names, add_servicer))

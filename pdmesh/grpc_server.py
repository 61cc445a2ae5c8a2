"""grpc.aio server scaffolding shared by gateway and workers: health, reflection, graceful stop."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import Callable, Iterable
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from opentelemetry.instrumentation.grpc import aio_server_interceptor, filters

from pdmesh.malformed_requests import RejectMalformedRequests
from pdmesh.transport.grpc_options import GRPC_OPTIONS


class AioServer:
    def __init__(self, service_names: Iterable[str], interceptors: Iterable[grpc.aio.ServerInterceptor] = ()) -> None:
        # Continues the caller's trace (traceparent + baggage) into this process. Health checks are
        # left out: probes are noise in traces, and the interceptor breaks the aio Health.Watch stream
        # (it iterates the handler's result; Watch writes through the context and returns None). So is
        # DecodeStreams, a call as long as the gateway's life: each of its streams traces itself, a child
        # of the gateway's span it carries (decode/decode_streams.py).
        tracing = aio_server_interceptor(filter_=filters.negate(filters.any_of(
            filters.health_check(), filters.full_method_name("/pdmesh.v1.Decode/DecodeStreams"))))
        self.server = grpc.aio.server(options=GRPC_OPTIONS,
                                      interceptors=[tracing, *interceptors, RejectMalformedRequests()])
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self._service_names = list(service_names)
        self.on_stop: list[Callable[[], None]] = []   # told first when the server stops (decode drains its calls)
        reflection.enable_server_reflection(
            [*self._service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], self.server)
        self.address = ""

    async def start(self, host: str, port: int, credentials: grpc.ServerCredentials | None = None) -> str:
        """Binds host:port (TLS when credentials are given), starts serving and marks SERVING."""
        if credentials is None:
            bound = self.server.add_insecure_port(f"{host}:{port}")
        else:
            bound = self.server.add_secure_port(f"{host}:{port}", credentials)
        if bound == 0:
            raise OSError(f"could not bind {host}:{port}")
        await self.server.start()
        for name in ["", *self._service_names]:
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self.address = f"{host}:{bound}"
        return self.address

    async def stop(self, grace_s: float = 5.0) -> None:
        """Marks NOT_SERVING, lets in-flight RPCs finish within grace_s, then stops."""
        for name in ["", *self._service_names]:
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        for hook in self.on_stop:
            hook()
        await self.server.stop(grace_s)


async def wait_for_termination_signal(exit_with_parent: bool = False) -> None:
    """Returns on SIGINT/SIGTERM, or (exit_with_parent) once the process that started us is gone."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    watchdog = loop.create_task(_watch_parent(stop)) if exit_with_parent else None
    await stop.wait()
    if watchdog is not None:
        watchdog.cancel()


async def _watch_parent(stop: asyncio.Event, interval_s: float = 1.0) -> None:
    parent_pid = os.getppid()
    while os.getppid() == parent_pid:  # a dead parent's children are re-parented
        await asyncio.sleep(interval_s)
    stop.set()


def write_ready_file(path: Path | None, **fields: object) -> None:
    """Atomically writes {"address": ..., ...} so a launcher knows the process is serving."""
    if path is None:
        return
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(fields))
    tmp.replace(path)

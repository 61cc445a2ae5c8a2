"""Gateway process: serves the Generation API in front of the worker pool."""

from __future__ import annotations

from gateway.pool import WorkerPool
from gateway.servicer import GenerationServicer
from gateway.tokenizer import PromptTokenizer
from pdmesh.config import GatewaySettings
from pdmesh.grpc_server import AioServer
from pdmesh.telemetry.metrics import MeshMetrics
from pdmesh.v1 import generate_pb2, generate_pb2_grpc

SERVICE_NAME = generate_pb2.DESCRIPTOR.services_by_name["Generation"].full_name


class Gateway:
    def __init__(self, settings: GatewaySettings) -> None:
        self._settings = settings
        self.metrics = MeshMetrics("gateway")
        self.metrics_address = ""
        self.pool = WorkerPool(settings.prefill_workers, settings.decode_workers)
        self._server = AioServer([SERVICE_NAME])
        servicer = GenerationServicer(self.pool, PromptTokenizer(settings.tokenizer), settings.request_timeout_s,
                                      self.metrics, settings.first_token_from)
        generate_pb2_grpc.add_GenerationServicer_to_server(servicer, self._server.server)

    async def start(self) -> str:
        telemetry = self._settings.telemetry
        if telemetry.metrics_port is not None:
            self.metrics_address = self.metrics.serve(telemetry.metrics_host, telemetry.metrics_port)
        address = await self._server.start(self._settings.host, self._settings.port)
        self.metrics.healthy.labels("gateway").set(1)
        return address

    async def stop(self, grace_s: float = 5.0) -> None:
        self.metrics.healthy.labels("gateway").set(0)
        await self._server.stop(grace_s)
        await self.pool.close()

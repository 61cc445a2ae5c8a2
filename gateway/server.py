"""Gateway process: the Generation API over gRPC and the OpenAI-compatible HTTP API, in front of a
worker pool fed by the config's lists and the Redis registry."""

from __future__ import annotations

from pathlib import Path

from gateway.auth import ApiKeyAuth
from gateway.chat_template import ChatTemplate
from gateway.generation import MeshGenerator
from gateway.openai_http import HttpLimits, OpenAIHttpServer
from gateway.pool import WorkerPool
from gateway.prefix_index import PrefixIndex
from gateway.routing import make_policy
from gateway.servicer import GenerationServicer
from gateway.tokenizer import PromptTokenizer
from pdmesh.config import GatewaySettings
from pdmesh.grpc_server import AioServer
from pdmesh.registry import RegistryWatcher
from pdmesh.telemetry.metrics import MeshMetrics
from pdmesh.v1 import generate_pb2, generate_pb2_grpc

SERVICE_NAME = generate_pb2.DESCRIPTOR.services_by_name["Generation"].full_name


class Gateway:
    def __init__(self, settings: GatewaySettings) -> None:
        self._settings = settings
        self.metrics = MeshMetrics("gateway")
        self.metrics_address = ""
        self.http_address = ""
        self.registry = (RegistryWatcher(settings.registry, settings.mesh_token)
                         if settings.registry.redis_url else None)
        self.pool = WorkerPool(settings.prefill_workers, settings.decode_workers, settings.worker_tls,
                               both_addresses=settings.workers,
                               cooldown_s=settings.worker_cooldown_s, wait_s=settings.worker_wait_s,
                               registry=self.registry, mesh_token=settings.mesh_token)
        self._index = (PrefixIndex(settings.kv_index_redis_url, settings.kv_index_redis_password,
                                   mesh_token=settings.mesh_token)
                       if settings.kv_index_redis_url else None)
        self.metrics.on_scrape(self._count_rejected)
        tokenizer = PromptTokenizer(settings.tokenizer)
        self.generator = MeshGenerator(self.pool, make_policy(settings.route_policy, self._index,
                                                              settings.route_load_tokens),
                                       tokenizer, settings, self.metrics)
        auth = ApiKeyAuth(settings.api_keys)
        self._server = AioServer([SERVICE_NAME])
        generate_pb2_grpc.add_GenerationServicer_to_server(GenerationServicer(self.generator, auth),
                                                           self._server.server)
        self._http = (OpenAIHttpServer(self.generator, auth, tokenizer,
                                       ChatTemplate.from_model_dir(Path(settings.tokenizer)), HttpLimits.of(settings))
                      if settings.http_port is not None else None)

    async def start(self) -> str:
        telemetry = self._settings.telemetry
        if telemetry.metrics_port is not None:
            self.metrics_address = self.metrics.serve(telemetry.metrics_host, telemetry.metrics_port)
        if self.registry is not None:
            await self.registry.start()
        address = await self._server.start(self._settings.host, self._settings.port)
        if self._http is not None:
            self.http_address = await self._http.start(self._settings.host, self._settings.http_port)
        self.metrics.healthy.labels("gateway").set(1)
        return address

    def _count_rejected(self) -> None:
        """What the registry and the KV index ignored as unsigned or forged (at each scrape)."""
        if self.registry is not None:
            self.metrics.redis_rejected.labels("gateway", "registry").set(self.registry.num_rejected)
        if self._index is not None:
            self.metrics.redis_rejected.labels("gateway", "kv_index").set(self._index.num_rejected)

    async def stop(self, grace_s: float = 5.0) -> None:
        self.metrics.healthy.labels("gateway").set(0)
        if self._http is not None:
            await self._http.stop()
        await self._server.stop(grace_s)
        if self.registry is not None:
            await self.registry.stop()
        await self.pool.close()
        if self._index is not None:
            self._index.close()

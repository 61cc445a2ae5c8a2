"""The gRPC Generation service: API key from `authorization` metadata, the client's deadline, and
the MeshGenerator's stream."""

from __future__ import annotations

from gateway.auth import ApiKeyAuth
from gateway.generation import MeshGenerator
from pdmesh.grpc_errors import maps_domain_errors
from pdmesh.v1 import generate_pb2, generate_pb2_grpc


def authorization_of(context) -> str | None:
    for key, value in context.invocation_metadata() or ():
        if key == "authorization":
            return value
    return None


class GenerationServicer(generate_pb2_grpc.GenerationServicer):
    def __init__(self, generator: MeshGenerator, auth: ApiKeyAuth) -> None:
        self._generator = generator
        self._auth = auth

    @maps_domain_errors
    async def Generate(self, request: generate_pb2.GenerateRequest, context):
        tenant = self._auth.tenant_of(authorization_of(context))
        async for response in self._generator.stream(request, tenant, context.time_remaining()):
            yield response

    @maps_domain_errors
    async def ListModels(self, request, context):
        self._auth.tenant_of(authorization_of(context))
        return await self._generator.list_models()

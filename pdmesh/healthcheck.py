"""`python -m pdmesh.healthcheck PORT [HOST]`: exit 0 when the gRPC health service on that port answers
SERVING (container health checks: compose, and anything without a native gRPC probe)."""

from __future__ import annotations

import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

TIMEOUT_S = 2.0


def serving(host: str, port: int) -> bool:
    with grpc.insecure_channel(f"{host}:{port}") as channel:
        try:
            response = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT_S)
        except grpc.RpcError:
            return False
    return response.status == health_pb2.HealthCheckResponse.SERVING


def main(argv: list[str]) -> int:
    port, host = int(argv[0]), argv[1] if len(argv) > 1 else "127.0.0.1"
    return 0 if serving(host, port) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

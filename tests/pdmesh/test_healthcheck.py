"""`python -m pdmesh.healthcheck PORT`, the containers' health check, against a real server: 0 while it
serves, 1 once it is stopping (NOT_SERVING) and when nothing listens."""

from __future__ import annotations

import asyncio
import subprocess
import sys

from pdmesh.grpc_server import AioServer
from worker.engine import free_port


async def _check(port: int) -> int:
    process = await asyncio.create_subprocess_exec(sys.executable, "-m", "pdmesh.healthcheck", str(port),
                                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return await asyncio.wait_for(process.wait(), 30)


async def test_zero_while_serving_one_when_stopping_or_gone():
    server = AioServer([])
    port = int((await server.start("127.0.0.1", 0)).rsplit(":", 1)[1])
    try:
        assert await _check(port) == 0
        await server.health.set("", 2)  # NOT_SERVING, as stop() sets it before draining
        assert await _check(port) == 1
    finally:
        await server.stop(0)
    assert await _check(free_port("127.0.0.1")) == 1

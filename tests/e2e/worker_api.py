"""Every method a peer can call on a worker's API port, and a call of each with an empty request
(the attack tests: refused without the mesh credentials)."""

from __future__ import annotations

import grpc

# "*": a response stream; "**": streams both ways.
WORKER_API_METHODS = {"prefill": ["WorkerInfo/GetInfo", "WorkerInfo/GetStats", "WorkerInfo/SpillKV",
                                  "Prefill/Prefill", "Prefill/Release"],
                      "decode": ["WorkerInfo/GetInfo", "WorkerInfo/GetStats", "WorkerInfo/SpillKV", "Decode/Decode*",
                                 "Decode/DecodeStreams**"]}


async def call_with_empty_request(channel: grpc.aio.Channel, method: str, metadata=()) -> grpc.StatusCode:
    path = f"/pdmesh.v1.{method.rstrip('*')}"
    try:
        if method.endswith("**"):
            async for _ in channel.stream_stream(path)(iter([b""]), timeout=10, metadata=metadata):
                pass
        elif method.endswith("*"):
            async for _ in channel.unary_stream(path)(b"", timeout=10, metadata=metadata):
                pass
        else:
            await channel.unary_unary(path)(b"", timeout=10, metadata=metadata)
    except grpc.aio.AioRpcError as error:
        return error.code()
    return grpc.StatusCode.OK

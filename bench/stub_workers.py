"""Stub prefill and decode workers for measuring the gateway alone (no engine behind them).

python -m bench.stub_workers READY_FILE [--num-tokens 16] [--token-interval-ms 0]
Serves WorkerInfo + Prefill on one port and WorkerInfo + Decode on another; prefill answers a KV
handle at once, decode streams `--num-tokens` tokens (the prompt's ids, repeated), one every
`--token-interval-ms` (an engine step: every stream's token comes out at the same tick, as from an
engine's batch; 0: as fast as gRPC sends them), over Decode or DecodeStreams. Writes {"prefill": host:port, "decode": host:port} to READY_FILE; stops on SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from decode.decode_streams import DecodeStreamsCall
from pdmesh.grpc_server import AioServer, wait_for_termination_signal, write_ready_file
from pdmesh.v1 import common_pb2, worker_pb2, worker_pb2_grpc

COMPAT = common_pb2.CompatInfo(model_fingerprint="stub", dtype="float32", block_size=32, layout="stub",
                               num_layers=4, block_nbytes=1024)


class StubWorker(worker_pb2_grpc.WorkerInfoServicer, worker_pb2_grpc.PrefillServicer,
                 worker_pb2_grpc.DecodeServicer):
    def __init__(self, role: str, num_tokens: int, token_interval_s: float = 0.0) -> None:
        self.info = worker_pb2.WorkerInfoResponse(role=role, model="tiny-llama", max_model_len=4096, compat=COMPAT,
                                                  kv_address="127.0.0.1:1", vocab_size=1024)
        self._num_tokens = num_tokens
        self._token_interval_s = token_interval_s
        self._step = asyncio.Condition()
        self._stepping: asyncio.Task | None = None

    async def GetInfo(self, request, context):
        return self.info

    async def Prefill(self, request, context):
        return worker_pb2.PrefillResponse(
            request_id=request.request_id, num_computed_tokens=len(request.prompt_token_ids), first_token_id=5,
            kv=common_pb2.KVHandle(transfer_id=request.request_id, kv_address="127.0.0.1:1", block_ids=[0],
                                   num_tokens=len(request.prompt_token_ids), compat=COMPAT))

    async def Decode(self, request, context):
        async for chunk in self._decode(request):
            yield chunk

    async def DecodeStreams(self, request_iterator, context):
        async for message in DecodeStreamsCall(self._decode).serve(request_iterator):
            yield message

    async def _next_step(self) -> None:
        """The engine's next step: every stream's next token at the same tick."""
        if not self._token_interval_s:
            await asyncio.sleep(0)
            return
        if self._stepping is None:
            self._stepping = asyncio.ensure_future(self._steps())
        async with self._step:
            await self._step.wait()

    async def _steps(self) -> None:
        while True:
            await asyncio.sleep(self._token_interval_s)
            async with self._step:
                self._step.notify_all()

    async def _decode(self, request):
        num_tokens = min(self._num_tokens, request.sampling.max_tokens)
        for i in range(num_tokens):
            await self._next_step()
            token_id = request.prompt_token_ids[i % len(request.prompt_token_ids)]
            yield worker_pb2.DecodeResponse(token_ids=[token_id], text=f"<{token_id}>")
        yield worker_pb2.DecodeResponse(finish_reason=common_pb2.FINISH_REASON_LENGTH)


async def serve(ready_file: Path, num_tokens: int, token_interval_s: float) -> None:
    addresses = {}
    servers = []
    for role, add in (("prefill", worker_pb2_grpc.add_PrefillServicer_to_server),
                      ("decode", worker_pb2_grpc.add_DecodeServicer_to_server)):
        worker = StubWorker(role, num_tokens, token_interval_s)
        server = AioServer([])
        worker_pb2_grpc.add_WorkerInfoServicer_to_server(worker, server.server)
        add(worker, server.server)
        addresses[role] = await server.start("127.0.0.1", 0)
        servers.append(server)
    write_ready_file(ready_file, **addresses)
    await wait_for_termination_signal(exit_with_parent=True)
    for server in servers:
        await server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("ready_file")
    parser.add_argument("--num-tokens", type=int, default=16)
    parser.add_argument("--token-interval-ms", type=float, default=0.0)
    args = parser.parse_args()
    asyncio.run(serve(Path(args.ready_file), args.num_tokens, args.token_interval_ms / 1e3))


if __name__ == "__main__":
    main()

"""Worker pool of the gateway: channels, worker info, and a round-robin pick of a compatible pair."""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass

import grpc
from opentelemetry.instrumentation.grpc import aio_client_interceptors

from pdmesh.compat import check_compatible
from pdmesh.errors import Incompatible, NoWorkerAvailable
from pdmesh.transport.grpc_options import GRPC_OPTIONS
from pdmesh.v1 import common_pb2, kv_transfer_pb2, kv_transfer_pb2_grpc, worker_pb2, worker_pb2_grpc


@dataclass
class Worker:
    address: str
    channel: grpc.aio.Channel
    info: worker_pb2.WorkerInfoResponse | None = None


class WorkerPool:
    policy = "round_robin"

    def __init__(self, prefill_addresses: list[str], decode_addresses: list[str], info_timeout_s: float = 5.0):
        self._prefill = [self._open(a) for a in prefill_addresses]
        self._decode = [self._open(a) for a in decode_addresses]
        self._prefill_turn = itertools.count()
        self._decode_turn = itertools.count()
        self._info_timeout_s = info_timeout_s

    async def pick_pair(self) -> tuple[Worker, Worker]:
        """Next prefill and decode worker (round-robin) that answer and agree on the KV layout."""
        prefill = await self._next_reachable(self._prefill, self._prefill_turn, "prefill")
        decode = await self._next_reachable(self._decode, self._decode_turn, "decode")
        try:
            check_compatible(prefill.info.compat, decode.info.compat)
        except Incompatible as exc:
            raise Incompatible(f"prefill {prefill.address} and decode {decode.address}: {exc}") from exc
        return prefill, decode

    async def release_kv(self, handle: common_pb2.KVHandle) -> bool:
        """Best effort: frees a prefill's pinned blocks when decode never took them."""
        async with grpc.aio.insecure_channel(handle.kv_address, options=GRPC_OPTIONS,
                                             interceptors=aio_client_interceptors()) as channel:
            try:
                response = await kv_transfer_pb2_grpc.KVTransferStub(channel).Release(
                    kv_transfer_pb2.ReleaseRequest(transfer_id=handle.transfer_id), timeout=self._info_timeout_s)
            except grpc.aio.AioRpcError:
                return False
        return response.released

    async def any_info(self) -> worker_pb2.WorkerInfoResponse:
        return (await self._next_reachable(self._decode, self._decode_turn, "decode")).info

    async def close(self) -> None:
        await asyncio.gather(*(w.channel.close() for w in self._prefill + self._decode))

    @staticmethod
    def _open(address: str) -> Worker:
        channel = grpc.aio.insecure_channel(address, options=GRPC_OPTIONS, interceptors=aio_client_interceptors())
        return Worker(address, channel)

    async def _next_reachable(self, workers: list[Worker], turn: itertools.count, role: str) -> Worker:
        for _ in range(len(workers)):
            worker = workers[next(turn) % len(workers)]
            if await self._ensure_info(worker):
                return worker
        raise NoWorkerAvailable(f"no reachable {role} worker among {[w.address for w in workers]}")

    async def _ensure_info(self, worker: Worker) -> bool:
        if worker.info is not None:
            return True
        try:
            stub = worker_pb2_grpc.WorkerInfoStub(worker.channel)
            worker.info = await stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=self._info_timeout_s)
        except grpc.aio.AioRpcError:
            return False
        return True

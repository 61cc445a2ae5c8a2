"""A KV port's per-method budgets over real gRPC: a call past its method's budget is refused at once
with RESOURCE_EXHAUSTED, and a slot comes back however its call ends (answered, failed, or a stream
its reader cancelled part-way)."""

from __future__ import annotations

import time

import grpc
import numpy as np
import pytest

from decode.kv.kv_port_client import KVPortClient
from pdmesh.errors import Overloaded, TransferNotFound
from pdmesh.transport.host_id import host_id
from pdmesh.v1 import common_pb2, kv_transfer_pb2, kv_transfer_pb2_grpc
from prefill.kv.grpc_kv_server import GrpcKVServer, KVTransferServicer
from prefill.kv.held_transfers import HeldTransfer, HeldTransfers
from prefill.kv.rpc_budgets import RpcBudget

BLOCK_NBYTES = 1024 * 1024
COMPAT = common_pb2.CompatInfo(model_fingerprint="fp", dtype="float32", block_size=32, layout="l",
                               num_layers=1, block_nbytes=BLOCK_NBYTES)
NUM_BLOCKS = 16   # a Pull of them all is 16 MiB in 1 MiB messages: its reader can stop part-way


@pytest.fixture
def port(no_thread_leak):
    """A KV port whose Pull may run once at a time."""
    held = HeldTransfers()
    held.hold(HeldTransfer("t1", tuple(range(NUM_BLOCKS)), tuple(b"h%d" % i for i in range(NUM_BLOCKS)), 1e18))
    servicer = KVTransferServicer(COMPAT, held, lambda ids: np.zeros((len(ids), BLOCK_NBYTES), np.uint8))
    server = GrpcKVServer(servicer, "127.0.0.1", 0, budgets=[RpcBudget("pull", ("/pdmesh.v1.KVTransfer/Pull",), 1)])
    receiver = KVPortClient(COMPAT, timeout_s=10)
    yield server, receiver
    receiver.close()
    server.stop(grace_s=0)


def _pull_all(receiver: KVPortClient, address: str, transfer_id: str = "t1") -> int:
    return sum(1 for _ in receiver.pull(address, transfer_id, list(range(NUM_BLOCKS)), verify=False))


def _until_served(receiver: KVPortClient, address: str, timeout_s: float = 5.0) -> int:
    """Pulls until one is not refused as over budget (its slot is back)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return _pull_all(receiver, address)
        except Overloaded:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def test_a_call_past_its_budget_is_refused_at_once_and_others_are_not(port):
    server, receiver = port
    channel = grpc.insecure_channel(server.address)
    stream = kv_transfer_pb2_grpc.KVTransferStub(channel).Pull(
        kv_transfer_pb2.PullRequest(transfer_id="t1", block_indexes=list(range(NUM_BLOCKS)), compat=COMPAT))
    try:
        next(stream)  # this stream holds the one slot while its reader waits
        started = time.monotonic()
        with pytest.raises(Overloaded, match="concurrent pull calls"):
            _pull_all(receiver, server.address)
        assert time.monotonic() - started < 1.0
        assert receiver.handshake(server.address, ["grpc"], host_id()).transport == "grpc"  # no budget holds it
        assert server.num_refused_busy == 1
    finally:
        stream.cancel()
        channel.close()
    assert _until_served(receiver, server.address) == NUM_BLOCKS  # the cancelled stream gave its slot back


def test_a_slot_comes_back_when_its_call_fails(port):
    server, receiver = port
    for _ in range(3):
        with pytest.raises(TransferNotFound):
            _pull_all(receiver, server.address, "never-minted")
    assert _pull_all(receiver, server.address) == NUM_BLOCKS
    assert server.num_refused_busy == 0

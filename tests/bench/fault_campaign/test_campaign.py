"""A fault's trials (bench/fault_campaign/campaign.py run_fault) against a fake gateway on loopback:
the fault first stops everything (an outage), then its victim restarts while the survivor serves.
The load keeps sending through the restart, the outage is measured, the requests moved off the
victim are counted as retried and the survivor's are not counted, and the row records the code
and transport it ran on."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import grpc

from bench.fault_campaign import campaign
from bench.fault_campaign.faults import Fault, Trial
from bench.fault_campaign.load import StreamLoad, Workload
from bench.fault_campaign.mesh import MeshSpec
from bench.stamp import machine, run_stamp
from pdmesh.v1 import common_pb2, generate_pb2, generate_pb2_grpc

VICTIM, SURVIVOR = "127.0.0.1:6003", "127.0.0.1:6004"
WORKLOAD = Workload(prompts=[[1, 2, 3]], expected=[[5, 6]], max_tokens=2)
OUTAGE_S, RESTART_S = 0.3, 0.5   # nothing completes in inject; the victim restarts in recover


class FakeGateway(generate_pb2_grpc.GenerationServicer):
    """Routes requests to the victim and the survivor in turn. During an outage nothing is answered;
    while the victim is down, a request routed to it waits for its restart and then moves to the
    survivor (a failover)."""

    def __init__(self) -> None:
        self.outage = threading.Event()
        self.victim_down = threading.Event()
        self.started_s: list[float] = []   # when each request arrived
        self._num_requests = 0

    async def Generate(self, request, context):
        self.started_s.append(time.monotonic())
        self._num_requests += 1
        decode, num_failovers = (VICTIM, SURVIVOR)[self._num_requests % 2], 0
        await asyncio.sleep(0.01)
        if decode == VICTIM and self.victim_down.is_set():
            await _until_clear(self.victim_down)
            decode, num_failovers = SURVIVOR, 1
        await _until_clear(self.outage)
        yield generate_pb2.GenerateResponse(token_ids=[5, 6], finish_reason=common_pb2.FINISH_REASON_LENGTH,
                                            transfer=generate_pb2.TransferStats(decode_worker=decode,
                                                                                num_failovers=num_failovers))


async def _until_clear(event: threading.Event) -> None:
    while event.is_set():
        await asyncio.sleep(0.01)


class KillAndRestart(Fault):
    name, description = "kill_fake_decode", "the fake gateway's victim down, then restarted"

    def __init__(self, gateway: FakeGateway) -> None:
        self.gateway = gateway
        self.restarts: list[tuple[float, float]] = []   # each recover's start and end

    def inject(self, mesh, index):
        at = time.monotonic()
        self.gateway.victim_down.set()
        self.gateway.outage.set()
        time.sleep(OUTAGE_S)
        self.gateway.outage.clear()
        return Trial(at, "decode-0", hit=True, note="streaming")

    def recover(self, mesh, trial):
        began = time.monotonic()
        time.sleep(RESTART_S)
        self.gateway.victim_down.clear()
        self.restarts.append((began, time.monotonic()))


class FakeMesh:
    prefill_names = ["prefill-0", "prefill-1"]
    decode_names = ["decode-0", "decode-1"]

    def __init__(self, address: str, tmp_path: Path) -> None:
        self.address = address
        self.spec = MeshSpec(tmp_path / "model", tmp_path / "run")

    def stream_load(self, workload: Workload, num_streams: int) -> StreamLoad:
        return StreamLoad(self.address, workload, num_streams, hang_s=10.0)

    def addresses_of(self, name: str) -> frozenset[str]:
        return frozenset({VICTIM}) if name == "decode-0" else frozenset()

    def leaks(self) -> list[str]:
        return []


async def test_the_load_runs_through_the_restart_and_the_outage_and_retried_requests_are_counted(
        tmp_path, monkeypatch):
    monkeypatch.setattr(campaign, "WARMUP_S", 0.2)
    monkeypatch.setattr(campaign, "PAUSE_S", 0.2)
    gateway = FakeGateway()
    server = grpc.aio.server()
    generate_pb2_grpc.add_GenerationServicer_to_server(gateway, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    fault = KillAndRestart(gateway)
    try:
        row = await campaign.run_fault(FakeMesh(f"127.0.0.1:{port}", tmp_path), WORKLOAD, fault, trials=1,
                                       num_streams=4)
    finally:
        await server.stop(None)
    (restart_began, restart_ended), = fault.restarts
    assert any(restart_began < at < restart_ended for at in gateway.started_s)   # not paused over
    assert (row.trials, row.trials_hit, row.kv_transport, len(row.outages_s)) == (1, 1, "auto", 1)
    assert row.outages_s[0] >= OUTAGE_S - 0.05 and row.failed_in_outages == 0
    assert row.outcomes["completed"] == row.requests
    assert row.on_victim["retried"] >= 1 and row.requests_on_victim == row.on_victim["completed"] + \
        row.on_victim["retried"]
    assert row.requests_on_victim < row.requests   # the survivor's requests meanwhile are not counted
    assert (row.code, row.machine) == (run_stamp().code, machine()) and row.run_at and row.meets_goal

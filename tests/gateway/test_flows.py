"""Flowing decodes: which streams a prompt's compute puts at risk, and a move through a real gateway
over stand-in workers (the real-engine version is tests/e2e/test_mesh_adaptive.py)."""

import asyncio
from dataclasses import dataclass

import pytest

from gateway.flows import Flows
from gateway.placement import tpot_with_one_more_s
from gateway.server import Gateway
from pdmesh.client import make_request, stream_generate
from pdmesh.config import GatewaySettings
from tests.gateway.fake_workers import FakeWorker


@dataclass
class _Worker:
    streams: int
    decode_step_s: float

    def queue(self) -> int:
        return self.streams

    def tpot_s(self) -> float:
        return self.decode_step_s if self.streams else 0.0


def _stream(flows: Flows, worker: str, tpot_s: float, num_tokens: int, num_left: int, movable: bool = True,
            tpot_slo_s: float = 0.05):
    stream = flows.open(worker, num_left + num_tokens, tpot_slo_s, movable)
    for i in range(num_tokens):
        stream.on_tokens(1, now=i * tpot_s)
    return stream


def test_a_stream_is_at_risk_when_the_stall_over_its_tokens_takes_its_tpot_past_the_slo():
    flows = Flows()
    # 0.04 s/token so far, 10 made + 90 left: a 1.0 s stall adds 1.0 / 99 = 0.0101 s -> 0.0501 s
    at_risk = _stream(flows, "a", 0.04, num_tokens=10, num_left=90)
    # 0.03 s/token: 0.0401 s, within
    safe = _stream(flows, "a", 0.03, num_tokens=10, num_left=90)
    elsewhere = _stream(flows, "b", 0.04, num_tokens=10, num_left=90)
    assert at_risk.tpot_after_stall_s(1.0) == pytest.approx(0.04 + 1.0 / 99)
    assert flows.ask_at_risk_to_move("a", stall_s=1.0, move_s=0.1, destination_tpots_s=[0.0]) == 1
    assert (at_risk.move_asked, safe.move_asked, elsewhere.move_asked) == (True, False, False)
    assert flows.ask_at_risk_to_move("a", stall_s=1.0, move_s=0.1, destination_tpots_s=[0.0]) == 0   # asked once
    assert flows.moves_asked == 1


def test_no_move_when_moving_costs_more_than_the_stall_or_the_stream_cannot_move():
    flows = Flows()
    moved_once = _stream(flows, "a", 0.04, num_tokens=10, num_left=90, movable=False, tpot_slo_s=0.01)
    starting = _stream(flows, "a", 0.04, num_tokens=1, num_left=99, tpot_slo_s=0.01)   # no TPOT yet: TTFT's
    ending = _stream(flows, "a", 0.04, num_tokens=10, num_left=1, tpot_slo_s=0.01)     # nothing left to save
    no_slo = _stream(flows, "a", 0.04, num_tokens=10, num_left=90, tpot_slo_s=0.0)     # asked for none
    fine = _stream(flows, "a", 0.04, num_tokens=10, num_left=90, tpot_slo_s=0.01)
    assert flows.ask_at_risk_to_move("a", stall_s=0.1, move_s=0.1, destination_tpots_s=[0.0]) == 0   # move as long
    assert flows.ask_at_risk_to_move("a", stall_s=0.2, move_s=0.1, destination_tpots_s=[0.0]) == 1
    assert [s.move_asked for s in (moved_once, starting, ending, no_slo, fine)] == [False, False, False, False,
                                                                                     True]


def test_a_stream_moves_only_where_it_would_be_decoded_within_its_slo():
    """a's stream is at risk (SLO 0.05 s); another worker that would run at 0.06 s with it has no
    room: nothing moves, as with no other worker at all; one at 0.04 s takes it."""
    flows = Flows()
    at_risk = _stream(flows, "a", 0.04, num_tokens=10, num_left=90)
    assert flows.ask_at_risk_to_move("a", stall_s=1.0, move_s=0.1, destination_tpots_s=[0.06]) == 0
    assert flows.ask_at_risk_to_move("a", stall_s=1.0, move_s=0.1, destination_tpots_s=[]) == 0
    assert flows.ask_at_risk_to_move("a", stall_s=1.0, move_s=0.1, destination_tpots_s=[0.06, 0.04]) == 1
    assert at_risk.move_asked


def test_a_destinations_tpot_with_one_more_stream_grows_with_its_batch():
    """b decodes 3 streams at its published 0.045 s: with one more, 0.06 s; idle, or not yet
    published: 0 (room)."""
    b = _Worker(streams=3, decode_step_s=0.045)
    assert tpot_with_one_more_s(b) == pytest.approx(0.06)
    assert tpot_with_one_more_s(_Worker(streams=0, decode_step_s=0.045)) == 0.0
    assert tpot_with_one_more_s(_Worker(streams=3, decode_step_s=0.0)) == 0.0


def test_closing_the_last_stream_forgets_its_worker():
    flows = Flows()
    stream = flows.open("a", 10, 0.05, movable=True)
    flows.close(stream)
    flows.close(stream)
    assert flows.streams == {}


async def test_a_stream_asked_to_move_resumes_on_the_other_worker_every_token_once(tiny_llama_dir):
    a, b = FakeWorker("both"), FakeWorker("both")
    a.token_delay_s = b.token_delay_s = 0.02
    addresses = [await a.server.start("127.0.0.1", 0), await b.server.start("127.0.0.1", 0)]
    gateway = Gateway(GatewaySettings(port=0, workers=addresses, disagg_policy="adaptive",
                                      tokenizer=str(tiny_llama_dir), mesh_token="t"))
    address = await gateway.start()
    prompt = list(range(3, 43))
    token_ids, last = [], None
    try:
        async for response in stream_generate(address, make_request(prompt, max_tokens=20)):
            token_ids += response.token_ids
            last = response
            if len(token_ids) == 4:
                flows = gateway.generator.disagg.flows
                (worker, streams), = flows.streams.items()
                assert flows.ask_at_risk_to_move(worker, stall_s=100.0, move_s=0.0,
                                                 destination_tpots_s=[0.0]) == 1
        await asyncio.sleep(0)
    finally:
        await gateway.stop(0)
        await a.server.stop(0)
        await b.server.stop(0)
    a_first = bool(a.requests) and not a.requests[0].request_id.endswith("-retry1")
    moved_from, moved_to, to_address = (a, b, addresses[1]) if a_first else (b, a, addresses[0])
    first, resumed = moved_from.requests[0], moved_to.requests[0]
    k = last.transfer.resumed_at_token   # tokens sent before the move (the fake echoes its prompt)
    assert 4 <= k < 20 and token_ids == prompt[:k] + prompt[:20 - k]
    assert (list(resumed.prompt_token_ids), resumed.sampling.max_tokens) == (prompt + prompt[:k], 20 - k)
    assert resumed.request_id == f"{first.request_id}-retry1"
    assert (last.transfer.num_moves, last.transfer.num_failovers, last.usage.completion_tokens) == (1, 0, 20)
    assert last.transfer.decode_worker == to_address
    assert gateway.generator.disagg.flows.streams == {}

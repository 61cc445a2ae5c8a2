"""Placement over workers taking either role, from set rates, queues and streams."""

from dataclasses import dataclass, field

import pytest

from gateway.disagg import DisaggCosts
from gateway.placement import Placement
from gateway.prompt_names import PromptNames
from gateway.seen_prefixes import SeenPrefixes
from gateway.slo import RequestSlo
from pdmesh.v1 import worker_pb2
from tests.gateway.fake_workers import info


@dataclass(eq=False)
class _Worker:
    address: str
    prefill_tokens_per_s: float
    streams: int = 0
    decode_step_s: float = 0.0   # published
    info: worker_pb2.WorkerInfoResponse = field(default_factory=lambda: info("both"))

    def queue(self) -> int:
        return self.streams

    def tpot_s(self) -> float:
        return self.decode_step_s if self.streams else 0.0


def _placement(ttft_slo_s: float = 2.5, handoff_s: float = 0.02, tpot_slo_s: float = 0.0) -> Placement:
    return Placement(DisaggCosts(initial_handoff_s=handoff_s), SeenPrefixes(), RequestSlo(ttft_slo_s, tpot_slo_s))


def _prompt(num_tokens: int, first: int = 0) -> PromptNames:
    return PromptNames(list(range(first, first + num_tokens)))


def _chosen(placement, prompt, workers):
    option = placement.choose(placement.options(prompt, workers, workers))
    return (option.prefill.address if option.prefill else None, option.decode.address)


def test_a_short_prompt_on_an_idle_mesh_is_served_whole_on_the_least_busy_worker():
    a, b = _Worker("a", 10_000, streams=3), _Worker("b", 10_000, streams=1)
    assert _chosen(_placement(), _prompt(100), [a, b]) == (None, "b")


def test_a_long_prompt_is_computed_where_the_fewest_streams_wait_for_it():
    """a decodes a full batch, b is idle: b computes the prompt; decoding it on a (remote) or on b
    (local) harms no stream then, and local is sooner; once b decodes streams too, the prompt is
    still computed on the one with fewer."""
    a, b = _Worker("a", 10_000, streams=30), _Worker("b", 10_000, streams=0)
    assert _chosen(_placement(), _prompt(2000), [a, b]) == (None, "b")
    b.streams = 4
    assert _chosen(_placement(), _prompt(2000), [a, b]) == (None, "b")
    option = _placement().choose(_placement().options(_prompt(2000), [a, b], [a, b]))
    assert option.harm_s == pytest.approx(0.2 * 4)


def test_a_queue_of_prompts_on_the_idle_worker_sends_the_next_to_the_other_within_the_slo():
    a, b = _Worker("a", 10_000, streams=2), _Worker("b", 10_000, streams=0)
    placement = _placement(ttft_slo_s=1.0)
    placement.costs.queued_tokens["b"] = 20_000   # 2 s of prompts queued on b: past the TTFT SLO
    assert _chosen(placement, _prompt(2000), [a, b]) == (None, "a")


def test_a_decode_whose_streams_run_past_the_requests_tpot_slo_is_taken_last():
    """a decodes one stream, publishing 50 ms steps, b three at 10 ms: the least harm is on a, but a
    request asking for 25 ms is decoded on b (its prompt still computed on a, where it harms fewer
    streams); one asking for none (or 60 ms) is served whole on a."""
    a = _Worker("a", 10_000, streams=1, decode_step_s=0.05)
    b = _Worker("b", 10_000, streams=3, decode_step_s=0.01)
    for tpot_slo_s, chosen in ((0.025, ("a", "b")), (0.0, (None, "a")), (0.06, (None, "a"))):
        assert _chosen(_placement(tpot_slo_s=tpot_slo_s), _prompt(100), [a, b]) == chosen


def test_an_idle_workers_last_published_step_time_is_no_batchs_tpot():
    """a published 50 ms steps while it decoded; now it serves nothing: a request asking for 25 ms is
    served whole on it (were its old figure its TPOT, the request would be decoded on b, 10 ms)."""
    a = _Worker("a", 10_000, streams=0, decode_step_s=0.05)
    b = _Worker("b", 10_000, streams=3, decode_step_s=0.01)
    assert _chosen(_placement(tpot_slo_s=0.025), _prompt(100), [a, b]) == (None, "a")


def test_the_reason_says_what_decided():
    a, b = _Worker("a", 10_000, streams=5), _Worker("b", 10_000, streams=0)
    cases = [({}, 2.5, "soonest"),                 # b: as soon as a, and no stream waits for it
             ({"b": 5_000}, 2.5, "least_harm"),    # b: 0.5 s later than a, to spare a's 5 streams
             ({"b": 5_000}, 0.1, "past_slo")]      # none within 0.1 s: the least bad
    for queued, ttft_slo_s, reason in cases:
        placement = _placement(ttft_slo_s=ttft_slo_s)
        placement.costs.queued_tokens.update(queued)
        options = placement.options(_prompt(2000), [a, b], [a, b])
        chosen = placement.choose(options)
        assert (chosen.prefill, chosen.decode.address, placement.reason(options, chosen)) == (None, "b", reason)
        assert chosen.decision(placement.reason(options, chosen)).reason == reason


def test_a_worker_that_has_published_no_rate_is_taken_as_fast_as_the_others():
    a, b = _Worker("a", 0.0), _Worker("b", 10_000, streams=5)
    option = _placement().choose(_placement().options(_prompt(1000), [a, b], [a, b]))
    assert (option.prefill, option.decode.address, option.ttft_s) == (None, "a", 0.1)   # idle, at b's rate
    b.prefill_tokens_per_s = 0.0   # none has: served whole on the least busy (its answer brings its rate)
    option = _placement().choose(_placement().options(_prompt(100), [a, b], [a, b]))
    assert (option.prefill, option.decode.address, option.decision().reason) == (None, "a", "unmeasured")


def test_a_cached_prefix_makes_its_holder_the_cheap_one():
    a, b = _Worker("a", 1_000, streams=1), _Worker("b", 1_000, streams=1)
    placement = _placement()
    shared = list(range(1024))
    placement.record(PromptNames(shared + [1, 2]), placement.choose(placement.options(
        PromptNames(shared + [1, 2]), [b], [b])))   # b computed it
    assert _chosen(placement, PromptNames(shared + [5, 6, 7]), [a, b]) == (None, "b")


async def test_the_gateway_places_each_request_over_both_role_workers(tiny_llama_dir):
    """Through a real gateway and two stand-in workers taking both roles: the first request is served
    whole on one (no rate known yet); with rates published, a long prompt arriving while one worker
    decodes streams is computed on the other."""
    from gateway.server import Gateway
    from pdmesh.client import generate, make_request
    from pdmesh.config import GatewaySettings
    from tests.gateway.fake_workers import FakeWorker

    a, b = FakeWorker("both"), FakeWorker("both")
    addresses = [await a.server.start("127.0.0.1", 0), await b.server.start("127.0.0.1", 0)]
    gateway = Gateway(GatewaySettings(port=0, workers=addresses, disagg_policy="adaptive",
                                      tokenizer=str(tiny_llama_dir), mesh_token="t"))
    address = await gateway.start()
    try:
        _, _, first = await generate(address, make_request([0, 5, 6], max_tokens=2))
        assert first.transfer.local_prefill
        disagg = gateway.generator.disagg
        assert disagg.decisions == {(True, "unmeasured"): 1}
        busy = next(w for w in gateway.pool.workers("decode") if w.address == first.transfer.decode_worker)
        busy.in_flight = 8   # the one that has published its rate decodes 8 streams for this gateway
        _, _, long = await generate(address, make_request([0, *range(3, 100)], max_tokens=2))
        assert long.transfer.local_prefill and long.transfer.decode_worker != busy.address
    finally:
        await gateway.stop(0)
        await a.server.stop(0)
        await b.server.stop(0)

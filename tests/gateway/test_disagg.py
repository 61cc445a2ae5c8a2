"""The conditional disaggregation cost model (gateway/disagg.py) with set measurements."""

from dataclasses import dataclass

from gateway.disagg import DisaggCosts, DisaggPolicy
from gateway.prompt_names import PromptNames
from gateway.seen_prefixes import SeenPrefixes
from pdmesh.v1 import common_pb2, worker_pb2
from tests.gateway.fake_workers import COMPAT, info


@dataclass
class _Worker:
    address: str
    prefill_tokens_per_s: float   # as it published it
    info: worker_pb2.WorkerInfoResponse


P, D = _Worker("p", 10_000.0, info("prefill")), _Worker("d", 10_000.0, info("decode"))


def _prompt(num_tokens: int, first: int = 0) -> list[int]:
    return list(range(first, first + num_tokens))


def _policy(prefill_rate: float, local_rate: float, handoff_s: float = 0.02, max_stall_s: float = 0.1):
    """A conditional policy, with P and D publishing these prompt rates."""
    P.prefill_tokens_per_s, D.prefill_tokens_per_s = prefill_rate, local_rate
    return DisaggPolicy("conditional", DisaggCosts(initial_handoff_s=handoff_s), max_stall_s)


def test_an_idle_decode_takes_a_prompt_it_computes_sooner_than_prefill_plus_the_handoff():
    policy = _policy(prefill_rate=10_000, local_rate=10_000)
    decision = policy.decide(PromptNames(_prompt(100)), P, D, decode_busy=False)  # 10 ms here vs 10 ms + 20 ms handoff
    assert (decision.local, decision.reason) == (True, "cheaper_local")
    assert (decision.local_s, decision.remote_s) == (0.01, 0.03)


def test_a_long_prompt_goes_remote_when_the_busy_decode_would_stall_its_streams():
    policy = _policy(prefill_rate=10_000, local_rate=10_000, max_stall_s=0.1)
    decision = policy.decide(PromptNames(_prompt(2000)), P, D, decode_busy=True)  # 0.2 s stall > 0.1 s
    assert (decision.local, decision.reason, decision.stall_s) == (False, "stall", 0.2)
    assert policy.decide(PromptNames(_prompt(2000)), P, D, decode_busy=False).local  # idle: nobody stalls


def test_a_queued_prefill_worker_makes_local_cheaper_and_a_queued_decode_makes_remote_cheaper():
    policy = _policy(prefill_rate=10_000, local_rate=5_000)
    assert not policy.decide(PromptNames(_prompt(400)), P, D, decode_busy=False).local  # 80 ms here vs 60 ms there
    policy.costs.queued_tokens["p"] = 4000                                # 0.4 s of work queued there
    assert policy.decide(PromptNames(_prompt(400)), P, D, decode_busy=False).local
    policy.costs.queued_tokens["d"] = 4000                                # and as much queued here
    assert not policy.decide(PromptNames(_prompt(400)), P, D, decode_busy=False).local
    assert policy.decisions == {(False, "cheaper_remote"): 2, (True, "cheaper_local"): 1}


def test_a_worker_that_has_published_no_rate_yet_gets_the_prompt_computed_remotely():
    for prefill_rate, local_rate in ((0.0, 10_000.0), (10_000.0, 0.0)):
        decision = _policy(prefill_rate, local_rate).decide(PromptNames(_prompt(100)), P, D, decode_busy=False)
        assert (decision.local, decision.reason) == (False, "unmeasured")


def test_the_handoff_is_what_this_gateway_observes():
    costs = DisaggCosts(initial_handoff_s=0.02)
    costs.observe_handoff(0.03)
    assert (costs.handoff_s.value, costs.handoff_s.num_samples) == (0.03, 1)


def test_fixed_policies_do_not_weigh_anything():
    costs = DisaggCosts(0.02)
    assert DisaggPolicy("remote", costs, 0.1).decide(PromptNames(_prompt(1)), P, D, False).local is False
    assert DisaggPolicy("local", costs, 0.1).decide(PromptNames(_prompt(10**6)), P, D, True).local is True


def test_a_prompt_mostly_cached_on_decode_is_computed_there_by_its_effective_length():
    policy = _policy(prefill_rate=10_000, local_rate=5_000, handoff_s=0.03, max_stall_s=0.1)
    shared = _prompt(1536)
    first = policy.decide(PromptNames(shared + _prompt(256, first=5000)), P, D, decode_busy=True)
    assert (first.local, first.reason, first.decode_cached_tokens) == (False, "cheaper_remote", 0)  # 0.36 vs 0.21 s
    second = policy.decide(PromptNames(shared + _prompt(256, first=9000)), P, D, decode_busy=True)
    assert (second.prefill_cached_tokens, second.decode_cached_tokens) == (1536, 1536)
    assert (second.local, second.reason) == (True, "cheaper_local")  # 256 tokens: 51 ms here, 26 + 30 ms there
    assert second.span_attributes()["pdmesh.disagg.decode_cached_tokens"] == 1536


def test_a_prefix_is_seen_only_under_the_cache_salt_it_was_sent_with():
    policy = _policy(prefill_rate=10_000, local_rate=1_000)   # the first goes remote: both workers see it
    policy.decide(PromptNames(_prompt(64), "salt-a"), P, D, decode_busy=False)
    tenant_a = policy.decide(PromptNames(_prompt(64), "salt-a"), P, D, decode_busy=False)
    tenant_b = policy.decide(PromptNames(_prompt(64), "salt-b"), P, D, decode_busy=False)
    assert (tenant_a.prefill_cached_tokens, tenant_a.decode_cached_tokens) == (63, 63)
    assert (tenant_b.prefill_cached_tokens, tenant_b.decode_cached_tokens) == (0, 0)


def test_seen_prefixes_match_whole_leading_blocks_and_forget_the_oldest():
    seen = SeenPrefixes(capacity_tokens=12)
    compat = common_pb2.CompatInfo(model_fingerprint="fp", block_size=4)

    def names(tokens: list[int]) -> list[bytes]:
        return PromptNames(tokens).of(compat)

    seen.record("d", names(_prompt(8)), 4)
    assert seen.cached_tokens("d", names(_prompt(10)), 4, 10) == 8
    assert seen.cached_tokens("d", names(_prompt(8)), 4, 8) == 7  # the last token is always computed
    assert seen.cached_tokens("d", names([99] + _prompt(9, 1)), 4, 10) == 0  # first block differs
    assert seen.cached_tokens("p", names(_prompt(8)), 4, 8) == 0
    seen.record("d", names(_prompt(8, first=100)), 4)  # 4 blocks > capacity 3: the oldest goes
    assert seen.cached_tokens("d", names(_prompt(8)), 4, 8) == 0
    assert seen.cached_tokens("d", names(_prompt(8, first=100)), 4, 9) == 8


def test_a_prompt_is_named_once_per_model_whatever_asks():
    prompt = PromptNames(_prompt(100), "salt-a")
    first = prompt.of(COMPAT)
    assert prompt.of(COMPAT) is first and prompt.num_hashed == 1 and len(first) == 3   # 3 full blocks of 32
    other_model = common_pb2.CompatInfo(model_fingerprint="other", block_size=32)
    assert prompt.of(other_model) != first and prompt.num_hashed == 2


def test_a_worker_paired_with_itself_serves_the_request_whole_whatever_the_policy():
    for name in ("remote", "conditional"):
        policy = DisaggPolicy(name, DisaggCosts(0.02), 0.1)
        assert (policy.decide(PromptNames(_prompt(100)), D, D, decode_busy=True).reason) == "one_worker"
        assert policy.decide(PromptNames(_prompt(100)), D, D, decode_busy=True).local

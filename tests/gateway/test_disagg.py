"""The conditional disaggregation cost model (gateway/disagg.py) with set measurements."""

from gateway.disagg import DisaggCosts, DisaggPolicy
from gateway.seen_prefixes import SeenPrefixes, prefix_hashes


def _prompt(num_tokens: int, first: int = 0) -> list[int]:
    return list(range(first, first + num_tokens))


def _policy(prefill_rate: float, local_rate: float, handoff_s: float = 0.02, max_stall_s: float = 0.1):
    costs = DisaggCosts(initial_tokens_per_s=1000.0, initial_handoff_s=handoff_s)
    costs.prefill_tokens_per_s.value, costs.local_tokens_per_s.value = prefill_rate, local_rate
    return DisaggPolicy("conditional", costs, max_stall_s)


def test_an_idle_decode_takes_a_prompt_it_computes_sooner_than_prefill_plus_the_handoff():
    policy = _policy(prefill_rate=10_000, local_rate=10_000)
    decision = policy.decide(_prompt(100), "p", "d", decode_busy=False)  # 10 ms here vs 10 ms + 20 ms handoff
    assert (decision.local, decision.reason) == (True, "cheaper_local")
    assert (decision.local_s, decision.remote_s) == (0.01, 0.03)


def test_a_long_prompt_goes_remote_when_the_busy_decode_would_stall_its_streams():
    policy = _policy(prefill_rate=10_000, local_rate=10_000, max_stall_s=0.1)
    decision = policy.decide(_prompt(2000), "p", "d", decode_busy=True)  # 0.2 s stall > 0.1 s
    assert (decision.local, decision.reason, decision.stall_s) == (False, "stall", 0.2)
    assert policy.decide(_prompt(2000), "p", "d", decode_busy=False).local  # idle: nobody stalls


def test_a_queued_prefill_worker_makes_local_cheaper_and_a_queued_decode_makes_remote_cheaper():
    policy = _policy(prefill_rate=10_000, local_rate=5_000)
    assert not policy.decide(_prompt(400), "p", "d", decode_busy=False).local  # 80 ms here vs 60 ms there
    policy.costs.queued_tokens["p"] = 4000                                # 0.4 s of work queued there
    assert policy.decide(_prompt(400), "p", "d", decode_busy=False).local
    policy.costs.queued_tokens["d"] = 4000                                # and as much queued here
    assert not policy.decide(_prompt(400), "p", "d", decode_busy=False).local
    assert policy.decisions == {(False, "cheaper_remote"): 2, (True, "cheaper_local"): 1}


def test_rates_are_measured_only_from_unqueued_requests():
    costs = DisaggCosts(initial_tokens_per_s=1000.0, initial_handoff_s=0.02)
    costs.observe_prefill(2000, 0.5, queued_before=0)
    costs.observe_prefill(2000, 5.0, queued_before=3000)  # waited behind others: says nothing of the rate
    costs.observe_local(100, 0.01, queued_before=0)
    costs.observe_handoff(0.03)
    assert (costs.prefill_tokens_per_s.value, costs.local_tokens_per_s.value, costs.handoff_s.value) == (
        4000.0, 10_000.0, 0.03)


def test_fixed_policies_do_not_weigh_anything():
    costs = DisaggCosts(1000.0, 0.02)
    assert DisaggPolicy("remote", costs, 0.1).decide(_prompt(1), "p", "d", False).local is False
    assert DisaggPolicy("local", costs, 0.1).decide(_prompt(10**6), "p", "d", True).local is True


def test_a_prompt_mostly_cached_on_decode_is_computed_there_by_its_effective_length():
    policy = _policy(prefill_rate=10_000, local_rate=5_000, handoff_s=0.03, max_stall_s=0.1)
    shared = _prompt(1536)
    first = policy.decide(shared + _prompt(256, first=5000), "p", "d", decode_busy=True)
    assert (first.local, first.reason, first.decode_cached_tokens) == (False, "cheaper_remote", 0)  # 0.36 vs 0.21 s
    second = policy.decide(shared + _prompt(256, first=9000), "p", "d", decode_busy=True)
    assert (second.prefill_cached_tokens, second.decode_cached_tokens) == (1536, 1536)
    assert (second.local, second.reason) == (True, "cheaper_local")  # 256 tokens: 51 ms here, 26 + 30 ms there
    assert second.span_attributes()["pdmesh.disagg.decode_cached_tokens"] == 1536


def test_a_prefix_is_seen_only_under_the_cache_salt_it_was_sent_with():
    policy = _policy(prefill_rate=10_000, local_rate=1_000)   # the first goes remote: both workers see it
    policy.decide(_prompt(64), "p", "d", decode_busy=False, cache_salt="salt-a")
    tenant_a = policy.decide(_prompt(64), "p", "d", decode_busy=False, cache_salt="salt-a")
    tenant_b = policy.decide(_prompt(64), "p", "d", decode_busy=False, cache_salt="salt-b")
    assert (tenant_a.prefill_cached_tokens, tenant_a.decode_cached_tokens) == (63, 63)
    assert (tenant_b.prefill_cached_tokens, tenant_b.decode_cached_tokens) == (0, 0)


def test_seen_prefixes_match_whole_leading_blocks_and_forget_the_oldest():
    seen = SeenPrefixes(block_tokens=4, capacity_tokens=12)
    seen.record("d", prefix_hashes(_prompt(8), 4))
    assert seen.cached_tokens("d", prefix_hashes(_prompt(10), 4), 10) == 8
    assert seen.cached_tokens("d", prefix_hashes(_prompt(8), 4), 8) == 7  # the last token is always computed
    assert seen.cached_tokens("d", prefix_hashes([99] + _prompt(9, 1), 4), 10) == 0  # first block differs
    assert seen.cached_tokens("p", prefix_hashes(_prompt(8), 4), 8) == 0
    seen.record("d", prefix_hashes(_prompt(8, first=100), 4))  # 4 blocks > capacity 3: the oldest goes
    assert seen.cached_tokens("d", prefix_hashes(_prompt(8), 4), 8) == 0
    assert seen.cached_tokens("d", prefix_hashes(_prompt(8, first=100), 4), 9) == 8

"""DistServe's goodput: the highest rate whose points reach the attainment goal, never a maximum
over points below it."""

from bench.serving.goodput import Timing, attainment, goodput, meets, tpot_ms
from bench.serving.workloads import SLOS, Slo

RELAXED = Slo("relaxed", 2500.0, 60.0)


def test_a_request_meets_the_slos_only_within_both_bounds():
    assert meets(Timing(2500.0, 60.0, 900.0), RELAXED)   # a long gap alone is no miss: TPOT is the mean
    assert not meets(Timing(2500.1, 10.0, 0.0), RELAXED) and not meets(Timing(10.0, 60.1, 0.0), RELAXED)


def test_failed_requests_count_against_attainment():
    timings = [Timing(100.0, 10.0, 20.0)] * 9
    assert attainment(timings, num_sent=10, slo=RELAXED) == 0.9
    assert attainment(timings, num_sent=12, slo=RELAXED) == 0.75
    assert attainment([], num_sent=0, slo=RELAXED) == 0.0


def test_goodput_is_the_highest_rate_reaching_the_goal_never_one_below_it():
    assert goodput([(1.0, 1.0), (2.0, 0.95), (4.0, 0.89), (6.0, 0.2)]) == 2.0
    assert goodput([(1.0, 0.5), (2.0, 0.3)]) == 0.0       # no point reaches 90%: none
    assert goodput([(1.0, 0.95), (2.0, 0.85), (3.0, 0.91)]) == 3.0   # a noisy dip below does not cap it


def test_tpot_is_the_mean_time_per_token_after_the_first():
    assert tpot_ms(latency_s=1.0, ttft_s=0.2, num_output_tokens=9) == 100.0
    assert tpot_ms(latency_s=0.2, ttft_s=0.2, num_output_tokens=1) == 0.0


def test_the_two_slo_pairs_are_the_issues():
    assert [(s.name, s.ttft_ms, s.tpot_ms) for s in SLOS] == [("relaxed", 2500.0, 60.0), ("tight", 1000.0, 25.0)]

from worker.compute_rate import ComputeRate


def test_busy_back_to_back_steps_move_the_rate_and_idle_gaps_do_not():
    rate = ComputeRate(initial_tokens_per_s=1000.0, min_tokens=256, max_gap_s=2.0, alpha=0.5)
    rate.on_step(2000, now=10.0)
    rate.on_step(2000, now=10.5)          # 2000 tokens in 0.5 s: 4000 tok/s; EWMA 1000 -> 2500
    assert rate.tokens_per_s == 2500.0 and rate.num_samples == 1
    rate.on_step(10, now=11.0)            # the 2000-token step took 0.5 s again: 2500 -> 3250
    assert rate.tokens_per_s == 3250.0
    rate.on_step(2000, now=11.001)        # a 10-token step is too small to say anything
    rate.on_step(2000, now=20.0)          # 9 s later: the engine sat idle, not computing
    assert (rate.tokens_per_s, rate.num_samples) == (3250.0, 2)
    assert rate.seconds_for(6500) == 2.0

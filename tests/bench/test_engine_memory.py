"""The engine-memory benchmark's summary of a run (bench/bench_engine_memory.py)."""

from bench.bench_engine_memory import summary


def test_growth_is_measured_from_the_first_sample_and_spread_over_the_requests():
    run = {"capacity": 0, "num_requests": 2048, "seconds": 20.0, "samples": [
        {"at_s": 0.0, "num_requests": 0, "pss_mib": 1000},
        {"at_s": 10.0, "num_requests": 1024, "pss_mib": 1030},
        {"at_s": 20.0, "num_requests": 2048, "pss_mib": 1050}]}
    assert summary(run) == {"capacity": 0, "pss_start_mib": 1000, "pss_end_mib": 1050, "growth": 0.05,
                            "kib_per_request": 25.0, "requests_per_s": 102.4}

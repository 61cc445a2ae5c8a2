"""The P:D mix of a point, from a real gateway metrics registry's text (the benchmark reads it over
HTTP from the gateway: tests/bench/serving/test_serve_smoke.py)."""

from prometheus_client import generate_latest

from bench.serving.mesh_mix import counters_of, mix_between, remote_share
from bench.serving.report import mix_table
from bench.serving.rows import Row
from pdmesh.telemetry.metrics import MeshMetrics


def test_a_points_mix_is_what_the_gateways_counters_gained_over_it():
    metrics = MeshMetrics("gateway")
    metrics.placed_prompt_tokens.labels("gateway", "local").inc(500)
    metrics.disagg_decisions.labels("gateway", "local", "soonest").inc(2)
    before = counters_of(generate_latest(metrics.registry).decode())
    metrics.placed_prompt_tokens.labels("gateway", "local").inc(1000)
    metrics.placed_prompt_tokens.labels("gateway", "remote").inc(3000)
    metrics.disagg_decisions.labels("gateway", "remote", "least_harm").inc(3)
    metrics.streams_moved.labels("gateway").inc()
    mix = mix_between(before, counters_of(generate_latest(metrics.registry).decode()))
    assert mix == {"local_tokens": 1000.0, "moved": 1.0, "reason:least_harm": 3.0, "remote_tokens": 3000.0}
    assert remote_share(mix) == 0.75 and remote_share({}) == 0.0


def test_a_rows_summary_shows_the_mix_only_where_there_is_one():
    row = Row("a", "w", "poisson", 1.0, 0, 1.0, 1, 0, 1.0, 4, mix={"local_tokens": 1.0, "remote_tokens": 3.0})
    assert row.summary().endswith("remote prompt tokens 75%, moved 0")
    assert "remote" not in Row("a", "w", "poisson", 1.0, 0, 1.0, 1, 0, 1.0, 4).summary()


def test_the_report_tables_each_pdmesh_points_mix_over_its_repeats():
    rows = [Row("mesh", "long", "poisson", 2.0, repeat, 2.0, 1, 0, 1.0, 4,
                mix={"local_tokens": 100.0 * repeat, "remote_tokens": 100.0, "reason:soonest": 2.0 + repeat})
            for repeat in (1, 3)] + [Row("vllm", "long", "poisson", 2.0, 1, 2.0, 1, 0, 1.0, 4)]
    assert mix_table(rows).splitlines()[2:] == ["| long | 2 | mesh | 37.5 [25–50] % | 0 [0–0] | soonest 4 |"]

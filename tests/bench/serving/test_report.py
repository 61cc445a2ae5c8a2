"""The serving report from made-up rows: ratios come from one repeat at a time, closed loops by
their worst point, goodput by DistServe's rule; merges refuse rows of other code or machines."""

import math

import pytest

from bench.serve import kept_rows, write_report
from bench.serving.report import figures, overhead_table, ratios
from bench.serving.rows import Row
from bench.serving.run import arm_order
from bench.serving.workloads import LONG, PROFILES, SHORT
from bench.stamp import RunStamp

STAMP = RunStamp("a" * 40, "", "box (cpu, 2 CPUs)", "2026-12-06 23:00")
FAST, SLOW = [100.0, 20.0, 30.0], [3000.0, 20.0, 30.0]   # TTFT, TPOT, ITL ms: in and out of both SLO pairs


def _row(arm, workload, point, repeat, timings=(), kind="poisson", offered=None, tokens=0, sent=None, **extra):
    return Row(arm=arm, workload=workload, kind=kind, point=point, repeat=repeat,
               offered_rate=point if offered is None else offered, num_sent=len(timings) if sent is None else sent,
               num_failed=0, duration_s=10.0, output_tokens=tokens, timings=[list(t) for t in timings],
               code=STAMP.code, machine=STAMP.machine, run_at=STAMP.run_at, **extra)


def _poisson(arm, repeat, good_up_to):
    """Points at 1, 2, 4 req/s, all requests in SLO up to `good_up_to` req/s, none past it."""
    return [_row(arm, "long", rate, repeat, [FAST if rate <= good_up_to else SLOW] * 10) for rate in (1.0, 2.0, 4.0)]


def test_goodput_ratios_come_from_one_repeat_each_against_that_repeats_best_arm():
    rows = [*_poisson("cand", 0, 4.0), *_poisson("vllm", 0, 2.0), *_poisson("replicas", 0, 1.0),
            *_poisson("cand", 1, 2.0), *_poisson("vllm", 1, 1.0), *_poisson("replicas", 1, 2.0)]
    (relaxed, tight) = sorted((r for r in ratios(figures(rows), "cand", ["vllm", "replicas"])), key=lambda r: r.measure)
    assert (relaxed.measure, relaxed.per_repeat, relaxed.best_other) == ("goodput, relaxed", (2.0, 1.0),
                                                                         ("vllm", "replicas"))
    assert relaxed.spread() == (1.0, 1.5, 2.0) and relaxed.meets(0.95) and not relaxed.meets(1.3)


def test_a_closed_loop_stands_by_its_worst_point():
    rows = [_row("cand", "short", 4, 0, kind="closed", tokens=1000), _row("cand", "short", 16, 0, kind="closed",
                                                                           tokens=2000),
            _row("vllm", "short", 4, 0, kind="closed", tokens=800), _row("vllm", "short", 16, 0, kind="closed",
                                                                          tokens=4000)]
    (ratio,) = ratios(figures(rows), "cand", ["vllm"])
    assert (ratio.measure, ratio.per_repeat) == ("tok/s @ 16", (0.5,))
    assert figures(rows)[("short", "tok/s @ 4", "vllm", 0)] == 80.0


def test_when_no_arm_serves_in_slo_the_ratio_says_so():
    rows = [*_poisson("cand", 0, 0.0), *_poisson("vllm", 0, 0.0)]
    assert all(math.isnan(r.spread()[1]) and not r.meets(0.95) for r in ratios(figures(rows), "cand", ["vllm"]))


def test_a_merge_refuses_rows_of_other_code_and_keeps_what_is_not_rerun():
    mine = [_row("vllm", "long", 1.0, 0), _row("vllm", "short", 4, 0), _row("cand", "long", 1.0, 0)]
    assert kept_rows(mine, ["cand"], ["long"], STAMP) == mine[:2]
    other = RunStamp("b" * 40, "", STAMP.machine, STAMP.run_at)
    with pytest.raises(SystemExit, match="ratios come from one run"):
        kept_rows(mine, ["cand"], ["long"], other)
    assert kept_rows(mine, ["vllm", "cand"], ["long", "short"], other) == []   # every old row is rerun: no refusal


def test_the_report_is_written_with_the_verdict_and_the_chart(tmp_path):
    rows = [*_poisson("cand", 0, 4.0), *_poisson("vllm", 0, 2.0)]
    write_report(tmp_path / "serving_x", rows, ["vllm", "cand"], "cand", "x")
    text = (tmp_path / "serving_x.md").read_text()
    assert "| long | goodput, relaxed | 2.00 [2.00–2.00] | vllm | met |" in text
    assert STAMP.code in text and (tmp_path / "serving_x_verdict.png").stat().st_size > 0


def test_seeds_come_from_the_workloads_name_and_point_and_arms_take_turns():
    assert SHORT.seed(4) == SHORT.seed(4.0) != SHORT.seed(16) != LONG.seed(4)
    assert [a for a in arm_order(["a", "b", "c"], 1)] == ["b", "c", "a"]
    assert all(w.num_prompts >= 200 for w in PROFILES["full"] if w.kind != "trace")


def test_the_meshs_overhead_is_its_ttft_at_one_request_per_second_over_one_core_vllms_per_repeat(tmp_path):
    def at(arm, repeat, ttft_ms, rate=1.0):
        return _row(arm, "long", rate, repeat, [[ttft_ms, 20.0, 30.0]] * 3)
    rows = [at("cand", 0, 110.0), at("vllm-1core", 0, 100.0), at("cand", 1, 130.0), at("vllm-1core", 1, 100.0),
            at("cand", 0, 999.0, rate=2.0), at("vllm-1core", 0, 1.0, rate=2.0), at("cand", 2, 50.0)]
    assert overhead_table(rows, "cand", "vllm-1core", 1.0, 1.1).splitlines()[2:] == [
        "| long | 1.2 [1.1–1.3] | not met |"]
    assert overhead_table([at("cand", 0, 105.0), at("vllm-1core", 0, 100.0)], "cand", "vllm-1core", 1.0,
                          1.1).splitlines()[2:] == ["| long | 1.05 | met |"]
    assert overhead_table(rows[:1], "cand", "vllm-1core", 1.0, 1.1) == ""   # the baseline did not run
    write_report(tmp_path / "serving_x", rows, ["vllm-1core", "cand"], "cand", "x")
    assert "| long | 1.2 [1.1–1.3] | not met |" in (tmp_path / "serving_x.md").read_text()


def test_a_merged_run_saves_the_workloads_and_arms_of_every_row_it_keeps(tmp_path, monkeypatch):
    import json

    import bench.serve as serve
    from bench.serving.rows import to_json

    monkeypatch.setattr(serve, "run_stamp", lambda: STAMP)
    monkeypatch.setattr(serve, "model_dir_for", lambda workloads: tmp_path)
    short_row = _row("vllm-1core", "short", 4, 0, kind="closed", tokens=100)
    monkeypatch.setattr(serve, "run", lambda arms, model_dir, workloads, repeats, stamp, log_dir, timeout_s, save:
                        save([short_row]) or [short_row])
    (tmp_path / "serving_full.json").write_text(json.dumps({"rows": to_json(_poisson("vllm", 0, 2.0))}))
    serve.main(["--workloads", "short", "--arms", "vllm-1core", "--merge", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "serving_full.json").read_text())
    assert [w["name"] for w in saved["workloads"]] == ["short", "long"]
    assert sorted(saved["arms"]) == ["vllm", "vllm-1core"]
    assert {(r["arm"], r["workload"]) for r in saved["rows"]} == {("vllm", "long"), ("vllm-1core", "short")}

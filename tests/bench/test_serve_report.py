"""bench.serve's report: goodput as DistServe defines it, tables, and the report's generated block."""

from bench.serve_report import best_goodput, best_goodput_under, tables_markdown, under_slo, write_report_tables


def _row(system: str, point: float, goodput: float, attainment: float, load: str = "rate",
         requests: list | None = None) -> dict:
    percentiles = {"50": 10.0, "90": 20.0, "99": 30.0, "mean": 12.0}
    return {"system": system, "workload": "long", "load": load, "point": point, "output_throughput": 100.0,
            "request_goodput": goodput, "slo_attainment": attainment, "ttft_ms": percentiles,
            "tpot_ms": percentiles, "itl_ms": percentiles, "e2el_ms": percentiles, "duration": 10.0,
            "requests": requests or [], "completed": len(requests) if requests else 40, "failed": 0}


def _results(rows: list[dict]) -> dict:
    return {"profile": "quick", "machine": {"date": "2026-12-03", "processor": "x86_64", "num_cpus": 2},
            "slo": {"ttft_ms": 2500.0, "tpot_ms": 60.0}, "systems": {"vllm": {}, "pdmesh": {}},
            "workloads": [{"name": "long", "description": "2,000 in", "num_prompts": 40, "load": "rate"}],
            "rows": rows}


def test_goodput_is_the_highest_rate_with_90_percent_in_slo_and_the_best_measured():
    rows = [_row("vllm", 1.0, 0.95, 1.0), _row("vllm", 2.0, 1.8, 0.9), _row("vllm", 3.0, 1.5, 0.5)]
    assert best_goodput(rows) == (2.0, 1.8)
    assert best_goodput([_row("vllm", 1.0, 0.5, 0.5)]) == (0.0, 0.5)


def test_the_generated_block_is_replaced_and_the_text_around_it_kept(tmp_path):
    report = tmp_path / "REPORT.md"
    report.write_text("# Report\n\nWhat the numbers say.\n")
    write_report_tables(_results([_row("vllm", 3.0, 2.8, 1.0)]), report)
    write_report_tables(_results([_row("pdmesh", 3.0, 1.0, 0.5)]), report)
    text = report.read_text()
    assert text.startswith("# Report\n\nWhat the numbers say.\n")
    assert text.count("<!-- serve:quick:begin") == 1 and text.count("<!-- serve:quick:end -->") == 1
    assert "| pdmesh | 3 | 100 | 10 / 20 / 30 | 10 / 30 | 30 | 1.00 | 50% |" in text
    assert "| vllm |" not in text
    assert "| pdmesh | 0 | 1.00 |" in text  # no rate met the SLO for 90% of requests


def test_failed_requests_are_shown_not_hidden_as_zeros():
    dead = {**_row("vllm-disagg", 4.0, 0.0, 0.0), "completed": 0, "failed": 40}
    partly = {**_row("vllm-disagg", 2.0, 1.0, 0.5), "completed": 30, "failed": 10}
    text = tables_markdown(_results([partly, dead]))
    assert "| vllm-disagg | 4 | every request failed | - | - | - | 0.00 | 0% |" in text
    assert "| vllm-disagg (10 failed) | 2 | 100 |" in text
    assert text.count("| 1.00 | 38% |") == 1  # 50% of the 30 completed = 38% of the 40 sent


def test_a_point_where_most_requests_failed_is_not_in_slo():
    few = {**_row("vllm-disagg", 1.0, 0.1, 1.0, requests=[[10.0, 10.0, 10.0]] * 4), "completed": 4, "failed": 28}
    assert best_goodput([few]) == (0.0, 0.1)
    assert best_goodput_under([few], {"ttft_ms": 1000.0, "tpot_ms": 25.0})[0] == 0.0


def test_a_run_of_some_systems_or_workloads_keeps_the_rows_of_the_others():
    from bench.serve import merged

    earlier = _results([_row("vllm", 3.0, 2.8, 1.0), _row("pdmesh", 3.0, 1.0, 0.5)])
    now = _results([_row("pdmesh", 3.0, 2.0, 0.9)])
    now["systems"] = {"pdmesh": {}}
    result = merged(earlier, now)
    assert [(r["system"], r["request_goodput"]) for r in result["rows"]] == [("vllm", 2.8), ("pdmesh", 2.0)]
    assert list(result["systems"]) == ["vllm", "pdmesh"]
    assert result["earlier_runs"][0]["systems"] == ["vllm"]
    other = _results([{**_row("pdmesh", 1.0, 0.5, 0.5), "workload": "other"}])
    other["systems"], other["workloads"] = {"pdmesh": {}}, [{"name": "other"}]
    again = merged(result, other)
    assert [(r["system"], r["workload"]) for r in again["rows"]] == [("vllm", "long"), ("pdmesh", "long"),
                                                                     ("pdmesh", "other")]
    assert [w["name"] for w in again["workloads"]] == ["long", "other"]


def test_goodput_under_another_slo_is_counted_from_each_requests_figures():
    slo = {"ttft_ms": 1000.0, "tpot_ms": 25.0}
    row = _row("vllm", 2.0, 0.0, 0.0, requests=[[900.0, 20.0, 50.0], [1100.0, 20.0, 50.0], [500.0, 30.0, 90.0],
                                                  [999.0, 25.0, 40.0]])
    assert under_slo(row, slo) == (0.2, 0.5)   # 2 of 4 in SLO over a 10 s run
    faster = _row("vllm", 1.0, 0.0, 0.0, requests=[[10.0, 10.0, 10.0]] * 9 + [[2000.0, 10.0, 10.0]])
    assert best_goodput_under([row, faster], slo) == (1.0, 0.9)

"""bench.serve's report: goodput as DistServe defines it, tables, and the report's generated block."""

from bench.serve_report import best_goodput, write_report_tables


def _row(system: str, point: float, goodput: float, attainment: float, load: str = "rate") -> dict:
    percentiles = {"50": 10.0, "90": 20.0, "99": 30.0, "mean": 12.0}
    return {"system": system, "workload": "long", "load": load, "point": point, "output_throughput": 100.0,
            "request_goodput": goodput, "slo_attainment": attainment, "ttft_ms": percentiles,
            "tpot_ms": percentiles, "itl_ms": percentiles, "e2el_ms": percentiles}


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

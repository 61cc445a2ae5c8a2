"""The fault report's parts: rows of an earlier run kept when a campaign is run in parts (--merge)."""

from __future__ import annotations

import json

import pytest

from bench.fault_campaign.campaign import FaultResult
from bench.faults import earlier_rows, markdown_table, write_report


def _row(fault: str, trials: int, probes_judged: int = 0, cross_tenant_hits: int = 0) -> FaultResult:
    return FaultResult(fault, "a fault", trials=trials, trials_hit=trials, requests=10, requests_hit=4,
                       outcomes={"completed": 9, "failed_clear": 1}, streams=16, run_at="2026-12-04 20:00",
                       probes_judged=probes_judged, cross_tenant_hits=cross_tenant_hits)


def test_a_report_row_reads_back_as_it_was_written(tmp_path):
    rows = [_row("restart_redis", 100, probes_judged=7), _row("sigkill_decode", 3),
            _row("sigstop_worker", 3, probes_judged=5, cross_tenant_hits=1)]
    write_report(rows, tmp_path, {"kv_transport": "grpc"})
    again = earlier_rows(tmp_path / "faults.json", "grpc")
    assert list(again.values()) == rows
    table = (tmp_path / "faults.md").read_text()
    assert markdown_table(list(again.values())) == table
    assert "| restart_redis | 2026-12-04 20:00 | 100 (100) | 10 (4) | 9 | 1 | 0 | 0 | 0 | 0 | 0 (7) | met |" in table
    assert "| sigkill_decode | 2026-12-04 20:00 | 3 (3) | 10 (4) | 9 | 1 | 0 | 0 | 0 | 0 | - | met |" in table
    assert "| 0 | 1 (5) | MISSED |" in table   # tenant B read tenant A's KV


def test_rows_of_another_transport_are_not_merged(tmp_path):
    write_report([_row("restart_redis", 100)], tmp_path, {"kv_transport": "shm"})
    with pytest.raises(SystemExit, match="over shm, not grpc"):
        earlier_rows(tmp_path / "faults.json", "grpc")
    assert earlier_rows(tmp_path / "missing.json", "grpc") == {}
    assert json.loads((tmp_path / "faults.json").read_text())["faults"][0]["streams"] == 16

"""The fault report's parts: rows of an earlier run kept when a campaign is run in parts (--merge)."""

from __future__ import annotations

import json

import pytest

from bench.fault_campaign.campaign import FaultResult
from bench.faults import earlier_rows, markdown_table, write_report


def _row(fault: str, trials: int) -> FaultResult:
    return FaultResult(fault, "a fault", trials=trials, trials_hit=trials, requests=10, requests_hit=4,
                       outcomes={"completed": 9, "failed_clear": 1}, streams=16, run_at="2026-12-04 20:00")


def test_a_report_row_reads_back_as_it_was_written(tmp_path):
    rows = [_row("restart_redis", 100), _row("sigkill_decode", 3)]
    write_report(rows, tmp_path, {"kv_transport": "grpc"})
    again = earlier_rows(tmp_path / "faults.json", "grpc")
    assert list(again.values()) == rows
    assert markdown_table(list(again.values())) == (tmp_path / "faults.md").read_text()
    assert "| restart_redis | 2026-12-04 20:00 | 100 (100) | 10 (4) | 9 | 1 | 0 | 0 | 0 | 0 | met |" in \
        (tmp_path / "faults.md").read_text()


def test_rows_of_another_transport_are_not_merged(tmp_path):
    write_report([_row("restart_redis", 100)], tmp_path, {"kv_transport": "shm"})
    with pytest.raises(SystemExit, match="over shm, not grpc"):
        earlier_rows(tmp_path / "faults.json", "grpc")
    assert earlier_rows(tmp_path / "missing.json", "grpc") == {}
    assert json.loads((tmp_path / "faults.json").read_text())["faults"][0]["streams"] == 16

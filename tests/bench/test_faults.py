"""The fault report's parts: rows of an earlier run kept when a campaign is run in parts (--merge)."""

from __future__ import annotations

import json
from dataclasses import replace

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


def test_a_later_part_adds_its_trials_and_outcomes_to_the_row():
    first = FaultResult("sigkill_prefill", "a fault", trials=40, trials_hit=38, requests=900, requests_hit=120,
                        outcomes={"completed": 899, "failed_clear": 1}, leaks=[], seconds=2000.0, streams=16,
                        not_completed={"failed_clear: UNAVAILABLE: down": 1}, trial_notes=["a", "b", "c"],
                        run_at="2026-12-05 11:20", probes_judged=30)
    later = FaultResult("sigkill_prefill", "a fault", trials=60, trials_hit=60, requests=1300, requests_hit=200,
                        outcomes={"completed": 1298, "failed_clear": 0, "hung": 2},
                        leaks=["prefill-0: 1 held transfer"],
                        seconds=3000.0, streams=16, not_completed={"hung: no end after 3 tokens": 2},
                        trial_notes=["d", "e", "f"], run_at="2026-12-06 10:00", probes_judged=50, cross_tenant_hits=1)
    both = first.plus(later)
    assert (both.trials, both.trials_hit, both.requests, both.requests_hit) == (100, 98, 2200, 320)
    assert both.outcomes == {"completed": 2197, "failed_clear": 1, "hung": 2}
    assert first.plus(replace(later, outcomes={"completed": 5, "hung": 0})).outcomes == {
        "completed": 904, "failed_clear": 1, "hung": 0}   # a count of 0 is kept
    assert both.not_completed == {"failed_clear: UNAVAILABLE: down": 1, "hung: no end after 3 tokens": 2}
    assert both.leaks == ["prefill-0: 1 held transfer"] and not both.meets_goal
    assert (both.seconds, both.probes_judged, both.cross_tenant_hits) == (5000.0, 80, 1)
    assert both.trial_notes == ["a", "b", "c", "d", "e"]
    assert both.run_at == "2026-12-05 11:20 + 2026-12-06 10:00"
    skipped = FaultResult("sigkill_prefill", "a fault", skipped="no store node", streams=16)
    assert first.plus(skipped) == first and skipped.plus(first) == first
    with pytest.raises(ValueError, match="cannot add sigkill_decode"):
        first.plus(FaultResult("sigkill_decode", "another", streams=16))


def test_a_stopped_row_misses_the_goal_says_where_and_stays_stopped_when_added_to():
    stopped = replace(_row("sigkill_prefill", 10), stopped="trial 9: RuntimeError: prefill-0 did not start")
    assert not stopped.meets_goal
    assert markdown_table([stopped]).splitlines()[-1].endswith(
        "| MISSED (stopped at trial 9: RuntimeError: prefill-0 did not start) |")
    assert _row("sigkill_prefill", 5).plus(stopped).stopped == stopped.stopped
    assert stopped.plus(_row("sigkill_prefill", 5)).stopped == stopped.stopped

"""The fault report's parts: each row stamped with the code, machine and time it ran on; rows of an
earlier run kept when a campaign is run in parts (--merge) only where they ran on the same code
(or flagged with --mixed-commits); a fault's trials added up (--add) only on one commit."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from bench.fault_campaign.campaign import FaultResult
from bench.faults import check_mergeable, earlier_rows, markdown_table, write_report

COMMIT = "7e0d60797d92f80d6b7ceff8b293b6c1cacefe5e"
OTHER_COMMIT = "569b327aa53b5a5bb9ea1f9ed0b3c1b46f0a2f11"


def _row(fault: str, trials: int, probes_judged: int = 0, cross_tenant_hits: int = 0, commit: str = COMMIT,
         kv_transport: str = "auto") -> FaultResult:
    return FaultResult(fault, "a fault", trials=trials, trials_hit=trials, requests=10,
                       outcomes={"completed": 9, "failed_clear": 1},
                       on_victim={"completed": 2, "retried": 1, "failed_clear": 1}, streams=16,
                       run_at="2026-12-04 20:00", probes_judged=probes_judged, cross_tenant_hits=cross_tenant_hits,
                       outages_s=[0.5, 4.0, 1.5], failed_in_outages=1, kv_transport=kv_transport, commit=commit,
                       machine="vm (Linux, 2 CPUs)")


def test_a_report_row_reads_back_as_it_was_written(tmp_path):
    rows = [_row("restart_redis", 100, probes_judged=7), _row("sigkill_decode", 3),
            _row("sigstop_worker", 3, probes_judged=5, cross_tenant_hits=1),
            _row("flip_kv_wire_bit", 3, kv_transport="grpc")]
    write_report(rows, tmp_path, {"kv_transport": None})
    again = earlier_rows(tmp_path / "faults.json")
    assert list(again.values()) == rows
    table = (tmp_path / "faults.md").read_text()
    assert markdown_table(list(again.values())) == table
    assert table.startswith("| fault | run (UTC) | commit | KV | trials (hit) | requests (on the victim) |")
    assert ("| restart_redis | 2026-12-04 20:00 | 7e0d607 | auto | 100 (100) | 10 (4) | 9 | 1 | 0 | 0 | 0 | "
            "2 / 1 / 1 | 4.0 / 1.5 (1) | 0 | 0 (7) | met |") in table
    assert "| sigkill_decode | 2026-12-04 20:00 | 7e0d607 | auto | 3 (3) | 10 (4) |" in table
    assert "| flip_kv_wire_bit | 2026-12-04 20:00 | 7e0d607 | grpc | 3 (3) |" in table
    assert "| 0 | 1 (5) | MISSED |" in table   # tenant B read tenant A's KV
    report = json.loads((tmp_path / "faults.json").read_text())
    assert report["commits"] == ["7e0d607"]
    assert (report["faults"][0]["commit"], report["faults"][0]["machine"]) == (COMMIT, "vm (Linux, 2 CPUs)")
    assert report["faults"][0]["requests_on_victim"] == 4


def test_a_report_of_rows_run_on_different_code_says_so_above_its_table():
    mixed = [_row("restart_redis", 100), _row("sigkill_decode", 3, commit=OTHER_COMMIT),
             replace(_row("sigstop_worker", 3), dirty="0123456789ab")]
    assert markdown_table(mixed).splitlines()[0] == (
        "**Rows run on 3 different commits, not one campaign** (7e0d607: restart_redis; 569b327: sigkill_decode; "
        "7e0d607+dirty.0123456789ab: sigstop_worker).")
    not_run = replace(_row("nvme_disk_full", 0, commit=""), skipped="needs root")   # measured nothing
    assert markdown_table([_row("restart_redis", 100), _row("sigkill_decode", 3), not_run]).startswith("| fault |")


def test_rows_run_on_other_code_are_not_merged_unless_asked():
    earlier = {"restart_redis": _row("restart_redis", 100, commit=OTHER_COMMIT),
               "sigkill_decode": _row("sigkill_decode", 3)}
    running = {"sigkill_decode": "auto"}
    with pytest.raises(SystemExit, match=r"rows of restart_redis ran on 569b327, not on this tree \(7e0d607\)"):
        check_mergeable(earlier, "7e0d607", running, add=False, mixed_commits=False)
    check_mergeable(earlier, "7e0d607", running, add=False, mixed_commits=True)   # kept, flagged
    check_mergeable(earlier, "7e0d607", {"restart_redis": "auto"}, add=False, mixed_commits=False)  # rerun
    check_mergeable({"restart_redis": replace(earlier["restart_redis"], skipped="no root")}, "7e0d607",
                    running, add=False, mixed_commits=False)   # a row not run measured nothing


def test_a_faults_trials_are_added_only_on_the_same_code_and_transport():
    earlier = {"sigkill_decode": _row("sigkill_decode", 40)}
    check_mergeable(earlier, "7e0d607", {"sigkill_decode": "auto"}, add=True, mixed_commits=False)
    with pytest.raises(SystemExit, match="--add: sigkill_decode's row ran on 7e0d607 over auto; this run is "
                                         r"7e0d607\+dirty.0123456789ab over auto"):
        check_mergeable(earlier, "7e0d607+dirty.0123456789ab", {"sigkill_decode": "auto"}, add=True,
                        mixed_commits=True)
    with pytest.raises(SystemExit, match="over auto; this run is 7e0d607 over grpc"):
        check_mergeable(earlier, "7e0d607", {"sigkill_decode": "grpc"}, add=True, mixed_commits=False)
    with pytest.raises(ValueError, match="cannot add sigkill_decode run on 569b327 to its row run on 7e0d607"):
        earlier["sigkill_decode"].plus(_row("sigkill_decode", 60, commit=OTHER_COMMIT))
    with pytest.raises(ValueError, match="over grpc to sigkill_decode on 16 over auto"):
        earlier["sigkill_decode"].plus(_row("sigkill_decode", 60, kv_transport="grpc"))


def test_a_row_from_before_rows_were_stamped_gets_its_reports_transport_and_an_unknown_commit(tmp_path):
    old_row = {"fault": "restart_redis", "description": "a fault", "trials": 100, "requests": 3302,
               "requests_hit": 1700, "outcomes": {"completed": 3302}, "streams": 16}
    (tmp_path / "faults.json").write_text(json.dumps({"settings": {"kv_transport": "grpc"}, "faults": [old_row]}))
    row = earlier_rows(tmp_path / "faults.json")["restart_redis"]
    assert (row.kv_transport, row.code, row.requests_on_victim, row.outages_s) == ("grpc", "unknown", 0, [])
    assert earlier_rows(tmp_path / "missing.json") == {}
    with pytest.raises(SystemExit, match="ran on unknown, not on this tree"):
        check_mergeable({"restart_redis": row}, "7e0d607", {"sigkill_decode": "auto"}, add=False,
                        mixed_commits=False)


def test_a_later_part_adds_its_trials_outcomes_and_outages_to_the_row():
    first = FaultResult("sigkill_prefill", "a fault", trials=40, trials_hit=38, requests=900,
                        outcomes={"completed": 899, "failed_clear": 1},
                        on_victim={"completed": 30, "retried": 9, "failed_clear": 1}, leaks=[], seconds=2000.0,
                        streams=16, not_completed={"failed_clear: UNAVAILABLE: down": 1}, trial_notes=["a", "b", "c"],
                        run_at="2026-12-05 11:20", probes_judged=30, outages_s=[1.0, 2.0], failed_in_outages=1,
                        kv_transport="auto", commit=COMMIT, machine="vm-a")
    later = FaultResult("sigkill_prefill", "a fault", trials=60, trials_hit=60, requests=1300,
                        outcomes={"completed": 1298, "failed_clear": 0, "hung": 2},
                        on_victim={"completed": 50, "retried": 20, "hung": 2},
                        leaks=["prefill-0: 1 held transfer"],
                        seconds=3000.0, streams=16, not_completed={"hung: no end after 3 tokens": 2},
                        trial_notes=["d", "e", "f"], run_at="2026-12-06 10:00", probes_judged=50, cross_tenant_hits=1,
                        outages_s=[7.5], failed_in_outages=2, kv_transport="auto", commit=COMMIT, machine="vm-b")
    both = first.plus(later)
    assert (both.trials, both.trials_hit, both.requests, both.requests_on_victim) == (100, 98, 2200, 112)
    assert both.outcomes == {"completed": 2197, "failed_clear": 1, "hung": 2}
    assert both.on_victim == {"completed": 80, "retried": 29, "failed_clear": 1, "hung": 2}
    assert (both.outages_s, both.failed_in_outages, both.longest_outage_s) == ([1.0, 2.0, 7.5], 3, 7.5)
    assert first.plus(replace(later, outcomes={"completed": 5, "hung": 0})).outcomes == {
        "completed": 904, "failed_clear": 1, "hung": 0}   # a count of 0 is kept
    assert both.not_completed == {"failed_clear: UNAVAILABLE: down": 1, "hung: no end after 3 tokens": 2}
    assert both.leaks == ["prefill-0: 1 held transfer"] and not both.meets_goal
    assert (both.seconds, both.probes_judged, both.cross_tenant_hits) == (5000.0, 80, 1)
    assert both.trial_notes == ["a", "b", "c", "d", "e"]
    assert (both.run_at, both.machine, both.code) == ("2026-12-05 11:20 + 2026-12-06 10:00", "vm-a + vm-b", "7e0d607")
    skipped = FaultResult("sigkill_prefill", "a fault", skipped="no store node", streams=16)
    assert first.plus(skipped) == first and skipped.plus(first) == first
    with pytest.raises(ValueError, match="cannot add sigkill_decode"):
        first.plus(FaultResult("sigkill_decode", "another", streams=16, kv_transport="auto", commit=COMMIT))


def test_a_stopped_row_misses_the_goal_says_where_and_stays_stopped_when_added_to():
    stopped = replace(_row("sigkill_prefill", 10), stopped="trial 9: RuntimeError: prefill-0 did not start")
    assert not stopped.meets_goal
    assert markdown_table([stopped]).splitlines()[-1].endswith(
        "| MISSED (stopped at trial 9: RuntimeError: prefill-0 did not start) |")
    assert _row("sigkill_prefill", 5).plus(stopped).stopped == stopped.stopped
    assert stopped.plus(_row("sigkill_prefill", 5)).stopped == stopped.stopped

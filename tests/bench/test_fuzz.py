"""The fuzz report's counting: every answer lands in one column, a server error misses the goal."""

from __future__ import annotations

import json

import grpc

from bench.fuzz import FuzzTestResult, cases_table, markdown_table, target_rows, write_report
from tests.e2e.fuzz_tally import FuzzTally


class _Error(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


def _tally() -> FuzzTally:
    tally = FuzzTally()
    tally.answered("Generate", "valid")
    tally.grpc_error("Generate", _Error(grpc.StatusCode.INVALID_ARGUMENT, "token ids [5, 7] outside the "
                                        "vocabulary [0, 1024)"), "prompt fuzzed")
    tally.grpc_error("Generate", _Error(grpc.StatusCode.INVALID_ARGUMENT, "token ids [9] outside the "
                                        "vocabulary [0, 1024)"), "prompt fuzzed")
    tally.http_answer("POST /v1/completions", 400, "invalid request: top_p: Input should be a number", "raw bytes")
    tally.http_answer("POST /v1/completions", 200, "", "valid")
    tally.http_answer("POST /v1/completions", 503, "decode worker failed", "temperature fuzzed")
    tally.grpc_error("KVTransfer.Pull (no token)", _Error(grpc.StatusCode.UNAUTHENTICATED, "not a mesh peer"))
    return tally


def test_each_answer_is_counted_once_by_target_case_and_status_and_reasons_fold_their_numbers():
    rows = {row["target"]: row for row in target_rows(json.loads(json.dumps(_tally().as_dict())))}
    generate = rows["Generate"]
    assert (generate["calls"], generate["answered"], generate["client_errors"], generate["other"]) == (
        3, 1, {"INVALID_ARGUMENT": 2}, {})
    assert generate["messages"] == [{"outcome": "INVALID_ARGUMENT", "count": 2,
                                     "message": "token ids [N, …] outside the vocabulary [N, N)"}]
    completions = rows["POST /v1/completions"]
    assert (completions["answered"], completions["client_errors"], completions["other"]) == (
        1, {"HTTP 400": 1}, {"HTTP 503": 1})
    assert rows["KVTransfer.Pull (no token)"]["client_errors"] == {"UNAUTHENTICATED": 1}
    assert "| POST /v1/completions | 3 | 1 | HTTP 400 1 | 2 | HTTP 503 1 |" in markdown_table(list(rows.values()))
    assert "| POST /v1/completions | temperature fuzzed | 1 | 0 | 0 | 1 |" in cases_table(list(rows.values()))


def test_a_server_error_or_a_failed_test_misses_the_goal(tmp_path):
    rows = target_rows(_tally().as_dict())
    passed = [FuzzTestResult("test_fuzzed_generate", "passed", 1.0)]
    write_report(rows, passed, 0, {"examples": 1}, tmp_path)
    assert not json.loads((tmp_path / "fuzz.json").read_text())["goal_met"]   # the 503
    clean = [row for row in rows if not row["other"]]
    write_report(clean, passed, 0, {"examples": 1}, tmp_path)
    assert json.loads((tmp_path / "fuzz.json").read_text())["goal_met"]
    write_report(clean, [FuzzTestResult("test_fuzzed_generate", "failed", 1.0, "assert ...")], 1, {}, tmp_path)
    assert not json.loads((tmp_path / "fuzz.json").read_text())["goal_met"]
    assert (tmp_path / "fuzz.png").stat().st_size > 0 and "| Generate |" in (tmp_path / "fuzz.md").read_text()

import grpc
import pytest

from bench.fault_campaign.outcomes import (Outcome, RequestResult, classify, cross_tenant_hits, longest_silence,
                                           not_completed)


class _Error(grpc.aio.AioRpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


@pytest.mark.parametrize("tokens,error,hung,outcome", [
    ([1, 2, 3], None, False, Outcome.COMPLETED),
    ([1, 2], None, False, Outcome.WRONG),                                   # ended short without an error
    ([1, 9], None, False, Outcome.WRONG),
    ([1, 9], _Error(grpc.StatusCode.UNAVAILABLE, "down"), False, Outcome.WRONG),  # wrong before it failed
    ([1], _Error(grpc.StatusCode.UNAVAILABLE, "decode worker failed"), False, Outcome.FAILED_CLEAR),
    ([], _Error(grpc.StatusCode.INVALID_ARGUMENT, "bad"), False, Outcome.FAILED_CLEAR),
    ([], _Error(grpc.StatusCode.UNAVAILABLE, ""), False, Outcome.FAILED_UNCLEAR),
    ([], _Error(grpc.StatusCode.UNKNOWN, "Exception calling application"), False, Outcome.FAILED_UNCLEAR),
    ([], _Error(grpc.StatusCode.INTERNAL, "internal error: AttributeError"), False, Outcome.FAILED_UNCLEAR),
    ([1], None, True, Outcome.HUNG),
])
def test_each_request_gets_one_outcome_against_the_monolithic_tokens(tokens, error, hung, outcome):
    assert classify(tokens, [1, 2, 3], error, hung)[0] == outcome


def test_not_completed_counts_each_other_outcome_with_its_detail():
    results = [RequestResult(0, 0.0, 1.0, Outcome.COMPLETED), RequestResult(1, 0.0, 1.0, Outcome.HUNG, "no end"),
               RequestResult(2, 0.0, 1.0, Outcome.HUNG, "no end"), RequestResult(3, 0.0, 1.0, Outcome.WRONG, "token 3")]
    assert not_completed(results) == {"hung: no end": 2, "wrong: token 3": 1}
    assert not_completed(results, most=1) == {"hung: no end": 2}


def test_a_probe_that_reused_cached_tokens_in_one_try_is_a_cross_tenant_hit():
    def probe(cached: int, outcome: Outcome = Outcome.COMPLETED, failovers: int = 0) -> RequestResult:
        return RequestResult(0, 0.0, 1.0, outcome, probe=True, prefill_cached_tokens=cached, num_failovers=failovers)

    results = [probe(0), probe(64), probe(0), RequestResult(0, 0.0, 1.0, Outcome.COMPLETED, prefill_cached_tokens=192),
               probe(192, failovers=1),                 # may have reused its own first try's KV: not judged
               probe(0, Outcome.FAILED_CLEAR)]         # not completed: not judged
    assert cross_tenant_hits(results) == (3, 1)


def _ran(started_s: float, ended_s: float) -> RequestResult:
    return RequestResult(0, started_s, ended_s, Outcome.COMPLETED)


def test_the_longest_silence_is_a_stall_with_requests_in_flight_not_a_pause_of_the_load():
    results = [_ran(0.0, 1.0), _ran(0.5, 2.0), _ran(1.5, 9.0),   # 2 -> 9: 7 s with one in flight, none ending
               _ran(9.0, 10.0),
               _ran(30.0, 31.0), _ran(30.5, 32.0)]                # 10 -> 30: paused, nothing in flight
    assert longest_silence(results) == (7.0, 2.0)
    assert longest_silence([_ran(20.0, 21.0), _ran(0.0, 1.0)]) == (1.0, 20.0)   # order given does not matter
    assert longest_silence([]) == (0.0, 0.0)

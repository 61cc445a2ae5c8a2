import asyncio

import pytest

from pdmesh.errors import InvalidRequest
from pdmesh.telemetry.metrics import MeshMetrics
from pdmesh.telemetry.observe import TokenTimer, observe_request
from pdmesh.telemetry.tracing import request_context


def _sample(metrics: MeshMetrics, name: str, **labels) -> float:
    return metrics.registry.get_sample_value(name, {"role": metrics.role, **labels}) or 0.0


def test_requests_are_counted_by_final_status_and_leave_the_in_flight_gauge():
    metrics = MeshMetrics("gateway")
    with observe_request(metrics):
        assert _sample(metrics, "pdmesh_requests_in_flight") == 1
    with pytest.raises(InvalidRequest), observe_request(metrics):
        raise InvalidRequest("bad")
    with pytest.raises(asyncio.CancelledError), observe_request(metrics):
        raise asyncio.CancelledError
    assert _sample(metrics, "pdmesh_requests_total", status="OK") == 1
    assert _sample(metrics, "pdmesh_requests_total", status="INVALID_ARGUMENT") == 1
    assert _sample(metrics, "pdmesh_requests_total", status="CANCELLED") == 1
    assert _sample(metrics, "pdmesh_requests_in_flight") == 0


def test_a_cancelled_request_is_logged_with_its_id(caplog):
    """A caller that goes away leaves a line in the worker's log (nothing else would show it)."""
    metrics = MeshMetrics("prefill")
    with caplog.at_level("INFO", logger="pdmesh.telemetry.observe"), pytest.raises(asyncio.CancelledError), \
            request_context("r-17"), observe_request(metrics):
        raise asyncio.CancelledError
    assert [r.getMessage() for r in caplog.records] == ["prefill request r-17 cancelled by its caller"]


def test_token_timer_records_one_ttft_and_an_itl_per_later_chunk():
    metrics = MeshMetrics("decode")
    timer = TokenTimer(metrics)
    for num_tokens in (1, 0, 1, 2):
        timer.on_chunk(num_tokens)
    assert _sample(metrics, "pdmesh_ttft_seconds_count") == 1
    assert _sample(metrics, "pdmesh_itl_seconds_count") == 2
    assert set(timer.span_attributes()) == {"pdmesh.ttft_s", "pdmesh.itl_p50_s", "pdmesh.itl_max_s"}


def test_metrics_endpoint_serves_the_registry():
    import urllib.request

    metrics = MeshMetrics("prefill")
    metrics.healthy.labels("prefill").set(1)
    address = metrics.serve("127.0.0.1", 0)
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read().decode()
    assert 'pdmesh_worker_healthy{role="prefill"} 1.0' in text


def test_scrape_hooks_run_before_the_metrics_are_read():
    import urllib.request

    metrics = MeshMetrics("prefill")
    metrics.on_scrape(lambda: metrics.kv_bytes.labels("prefill", "sent", "grpc").inc(5))
    address = metrics.serve("127.0.0.1", 0)
    for expected in (5.0, 10.0):
        text = urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read().decode()
        assert f'pdmesh_kv_transfer_bytes_total{{direction="sent",role="prefill",transport="grpc"}} {expected}' in text

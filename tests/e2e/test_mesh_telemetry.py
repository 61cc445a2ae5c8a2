"""Traces cross every hop of a real cluster; each process's /metrics counts what happened."""

from __future__ import annotations

import asyncio
import json
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdmesh.client import make_request, stream_generate
from pdmesh.v1 import generate_pb2_grpc

pytestmark = pytest.mark.vllm

CLIENT_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN_ID = "00f067aa0ba902b7"
OUR_SPANS = {"gateway.generate", "prefill", "decode", "kv.transfer", "kv.open"}  # kv.open: shared memory


def _ancestors(span, by_id) -> list[str]:
    names, seen = [], {span.span_id}
    while span.parent_span_id in by_id:
        span = by_id[span.parent_span_id]
        assert span.span_id not in seen, f"parent cycle at {span.name}"
        seen.add(span.span_id)
        names.append(span.name)
    return names


async def test_one_request_is_one_trace_across_processes(cluster, otlp_receiver):
    request_id = "traced-request-1"
    traceparent = f"00-{CLIENT_TRACE_ID}-{CLIENT_SPAN_ID}-01"
    async with grpc.aio.insecure_channel(cluster.gateway_address) as channel:
        stream = generate_pb2_grpc.GenerationStub(channel).Generate(
            make_request([0] + list(range(500, 570)), max_tokens=4, request_id=request_id),
            metadata=[("traceparent", traceparent)])
        responses = [r async for r in stream]
    assert responses[-1].transfer.num_bytes > 0

    def mine(spans):
        return [s for s in spans if s.trace_id == CLIENT_TRACE_ID]

    spans = mine(otlp_receiver.wait_for(lambda all_: OUR_SPANS <= {s.name for s in mine(all_)}))
    by_name = {s.name: s for s in spans}
    assert OUR_SPANS <= set(by_name), sorted(by_name)
    by_id = {s.span_id: s for s in spans}
    assert len(by_id) == len(spans), "span ids collide across processes"
    assert {s.service for s in spans} >= {"pdmesh-gateway", "pdmesh-prefill", "pdmesh-decode",
                                          "pdmesh-decode-engine", "pdmesh-prefill-engine"}
    rpc_span = by_id[by_name["gateway.generate"].parent_span_id]  # the gRPC instrumentation's server span
    assert (rpc_span.name, rpc_span.parent_span_id) == ("/pdmesh.v1.Generation/Generate", CLIENT_SPAN_ID)
    assert "gateway.generate" in _ancestors(by_name["prefill"], by_id)
    assert "gateway.generate" in _ancestors(by_name["decode"], by_id)
    assert _ancestors(by_name["kv.transfer"], by_id)[0] == "decode"
    assert "kv.transfer" in _ancestors(by_name["kv.open"], by_id)
    assert [(s.service, s.name) for s in spans if s.attributes.get("pdmesh.client_request_id") != request_id] == []
    mesh_request_ids = {s.attributes.get("pdmesh.request_id") for s in spans}   # the gateway's, which workers act on
    assert len(mesh_request_ids) == 1 and request_id not in mesh_request_ids

    transfer = by_name["kv.transfer"].attributes
    assert (transfer["pdmesh.kv.blocks"], transfer["pdmesh.kv.bytes"]) == (3, 3 * 131072)
    assert transfer["pdmesh.kv.gbps"] > 0 and transfer["pdmesh.kv.checksum"] == "ok"
    assert transfer["pdmesh.kv.transport"] == "shm"  # the cluster's workers share a host: "auto" agrees shm
    assert by_name["kv.open"].attributes["pdmesh.kv.blocks"] == 3
    assert by_name["gateway.generate"].attributes["pdmesh.route.decode"] == cluster.decode_addresses[0]
    assert by_name["prefill"].attributes["pdmesh.tokens_computed"] == 71
    assert by_name["decode"].attributes["pdmesh.completion_tokens"] == 4
    assert by_name["decode"].attributes["pdmesh.ttft_s"] > 0


async def _responses(address: str, request) -> list:
    return [response async for response in stream_generate(address, request)]


def _scrape(address: str) -> dict[tuple[str, tuple], float]:
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read().decode()
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def _value(scrape: dict, name: str, **labels) -> float:
    return scrape.get((name, tuple(sorted(labels.items()))), 0.0)


async def test_metrics_count_requests_ttft_and_kv_bytes(cluster):
    addresses = cluster.metrics_addresses
    assert sorted(addresses) == ["decode-0", "gateway", "prefill-0"]
    before = {name: _scrape(address) for name, address in addresses.items()}
    prompts = [[0] + [(seed * 31 + i * 7) % 1000 + 3 for i in range(79)] for seed in range(3)]
    streams = await asyncio.gather(*(_responses(cluster.gateway_address, make_request(p, max_tokens=3))
                                     for p in prompts))
    num_bytes = sum(responses[-1].transfer.num_bytes for responses in streams)
    # an inter-token gap is observed between consecutive chunks that carry tokens (a busy engine
    # may stream two tokens in one chunk)
    num_gaps = sum(sum(1 for r in responses if r.token_ids) - 1 for responses in streams)
    assert num_bytes == 3 * 3 * 131072

    after = {name: _scrape(address) for name, address in addresses.items()}

    def delta(process: str, name: str, **labels) -> float:
        return _value(after[process], name, **labels) - _value(before[process], name, **labels)

    for process, role in (("gateway", "gateway"), ("prefill-0", "prefill"), ("decode-0", "decode")):
        assert delta(process, "pdmesh_requests_total", role=role, status="OK") == 3
        assert delta(process, "pdmesh_ttft_seconds_count", role=role) == 3
        assert _value(after[process], "pdmesh_worker_healthy", role=role) == 1
    assert delta("decode-0", "pdmesh_kv_transfer_bytes_total", role="decode", direction="received",
                 transport="shm") == num_bytes
    assert delta("prefill-0", "pdmesh_kv_transfer_bytes_total", role="prefill", direction="sent",
                 transport="shm") == num_bytes
    assert delta("decode-0", "pdmesh_kv_transfer_gbps_count", role="decode", transport="shm") == 3
    assert delta("decode-0", "pdmesh_kv_cache_hit_tokens_total", role="decode", tier="peer") == 3 * 80
    assert delta("decode-0", "pdmesh_kv_cache_query_tokens_total", role="decode") == 3 * 80
    assert delta("gateway", "pdmesh_itl_seconds_count", role="gateway") == num_gaps
    assert ("pdmesh_engine_queue_depth", (("role", "decode"),)) in after["decode-0"]
    assert _value(after["prefill-0"], "pdmesh_kv_tier_occupancy_bytes", role="prefill", tier="device") >= 0


@pytest.mark.parametrize("process, logger", [("gateway", "gateway.generation"), ("prefill-0", "prefill.servicer"),
                                             ("decode-0", "decode.servicer")])
def test_logs_are_json_lines_with_request_and_trace_ids(cluster, process, logger):
    """Runs after the traced request above (same module, file order)."""
    lines = (cluster.run_dir / f"{process}.log").read_text().splitlines()
    entries = [json.loads(line) for line in lines if line.startswith("{")]
    traced = [e for e in entries if e["client_request_id"] == "traced-request-1" and e["logger"] == logger]
    assert len(traced) == 1, entries[-5:]
    assert traced[0]["request_id"].startswith("traced-request-1-")   # the gateway's, which the workers act on
    assert traced[0]["trace_id"] == CLIENT_TRACE_ID
    assert set(traced[0]) >= {"ts", "level", "message", "span_id"}


@pytest.mark.parametrize("process", ["prefill-0", "decode-0"])
def test_each_worker_froze_its_start_up_heaps(cluster, process):
    """A model worker's full garbage collection walks its whole heap holding the GIL, and its KV
    threads wait (pdmesh/gc_heap.py): the heaps that exist once the engine has started are frozen."""
    lines = (cluster.run_dir / f"{process}.log").read_text().splitlines()
    messages = [json.loads(line)["message"] for line in lines if line.startswith("{")]
    model_worker = [m for m in messages if m.startswith("model worker heap: ")]
    own = [m for m in messages if m.startswith("worker process heap: ")]
    assert len(model_worker) == 1 and len(own) == 1, messages[:20]
    assert int(model_worker[0].split()[3]) > 100_000, model_worker   # torch, the model, vLLM's runner

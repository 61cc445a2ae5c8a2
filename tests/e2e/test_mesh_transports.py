"""The mesh on each KV transport forced in turn (shared memory, Mooncake Transfer Engine over TCP,
gRPC): greedy output equals monolithic vLLM token for token; the transport shows in the kv.transfer
span and the Prometheus `transport` label; and the wrong-KV control: KV altered between producer
and consumer changes the output when the checksum is off, and is caught and recomputed when on."""

from __future__ import annotations

import asyncio
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdmesh.client import generate, make_request
from pdmesh.cluster import LocalCluster
from tests.e2e.conftest import KV_TRANSPORTS, MAX_TOKENS, PROMPT_LENGTHS, assert_nothing_pinned, tamper_prompts, \
    telemetry_flags, token_prompts, worker_stats

pytestmark = pytest.mark.vllm
FAULT_ARGS = ["--kv_faults.tamper_request_prefix", "tamper-",
              "--kv_faults.unverified_request_prefix", "tamper-unverified-"]


@pytest.fixture(scope="module", params=KV_TRANSPORTS)
def mesh(request, tiny_llama_dir, reference, otlp_receiver, tmp_path_factory):
    transport = request.param
    with LocalCluster(tiny_llama_dir, tmp_path_factory.mktemp(f"cluster-{transport}"),
                      worker_args=["--kv_transport", transport, *FAULT_ARGS],
                      telemetry_args=telemetry_flags(otlp_receiver.endpoint)) as running:
        yield transport, running
        assert_nothing_pinned(running)


async def test_greedy_tokens_equal_monolithic_on_each_transport(mesh, reference):
    transport, cluster = mesh
    expected = reference["runs"][0]["token_ids"]
    results = await asyncio.gather(*(generate(cluster.gateway_address, make_request(p, max_tokens=MAX_TOKENS))
                                     for p in token_prompts()))
    for (token_ids, _, last), want, length in zip(results, expected, PROMPT_LENGTHS):
        assert token_ids == want, f"{transport}: prompt of {length} tokens diverged"
    assert sum(last.transfer.num_blocks for _, _, last in results) > 0
    again = await generate(cluster.gateway_address, make_request(token_prompts()[-1], max_tokens=MAX_TOKENS))
    assert again[0] == expected[-1]  # one at a time too


def _scrape(address: str) -> dict:
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


async def test_the_transport_is_in_the_span_and_the_metric_label(mesh, otlp_receiver):
    transport, cluster = mesh
    request_id = f"labelled-{transport}"
    labels = (("direction", "received"), ("role", "decode"), ("transport", transport))
    sent = (("direction", "sent"), ("role", "prefill"), ("transport", transport))
    before = (_scrape(cluster.metrics_addresses["decode-0"]), _scrape(cluster.metrics_addresses["prefill-0"]))
    prompt = [0] + [(i * 13 + len(transport)) % 1000 + 3 for i in range(99)]  # 4 blocks, sent by no other test
    _, _, last = await generate(cluster.gateway_address, make_request(prompt, max_tokens=2, request_id=request_id))
    assert last.transfer.num_bytes == 4 * 131072

    def mine(spans):
        return [s for s in spans if s.name == "kv.transfer" and s.attributes.get("pdmesh.request_id") == request_id]

    (span,) = mine(otlp_receiver.wait_for(lambda spans: mine(spans)))
    assert (span.attributes["pdmesh.kv.transport"], span.attributes["pdmesh.kv.checksum"]) == (transport, "ok")
    assert span.attributes["pdmesh.kv.bytes"] == last.transfer.num_bytes
    after = (_scrape(cluster.metrics_addresses["decode-0"]), _scrape(cluster.metrics_addresses["prefill-0"]))
    key = "pdmesh_kv_transfer_bytes_total"
    assert after[0][(key, labels)] - before[0].get((key, labels), 0) == last.transfer.num_bytes
    assert after[1][(key, sent)] - before[1].get((key, sent), 0) == last.transfer.num_bytes


async def test_altered_kv_changes_the_output_unchecked_and_is_recomputed_when_checked(mesh, reference):
    """Proof the equivalence test can fail: the same alteration, with the checksum off, gives other
    tokens; with it on, every altered block is refused and recomputed, and the tokens are right."""
    transport, cluster = mesh
    index = KV_TRANSPORTS.index(transport)
    wants = reference["runs"][8]["token_ids"][2 * index:2 * index + 2]
    unchecked, checked = tamper_prompts(transport)
    before = await worker_stats(cluster.decode_addresses[0])
    token_ids, _, last = await generate(cluster.gateway_address, make_request(
        unchecked, max_tokens=MAX_TOKENS, request_id=f"tamper-unverified-{transport}"))
    assert last.transfer.num_blocks > 0
    assert token_ids != wants[0], f"{transport}: altered KV left the output unchanged: the control proves nothing"
    middle = await worker_stats(cluster.decode_addresses[0])
    assert middle.kv_failed_blocks == before.kv_failed_blocks
    token_ids, _, last = await generate(cluster.gateway_address, make_request(
        checked, max_tokens=MAX_TOKENS, request_id=f"tamper-{transport}"))
    assert token_ids == wants[1]
    after = await worker_stats(cluster.decode_addresses[0])
    assert after.kv_failed_blocks - middle.kv_failed_blocks == -(-len(checked) // 32)  # every block refused
    assert last.transfer.num_blocks == 0

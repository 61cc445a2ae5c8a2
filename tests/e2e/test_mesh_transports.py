"""The mesh on each KV transport forced in turn (shared memory, Mooncake Transfer Engine over TCP,
gRPC), 1 prefill (chunked prefill: at most 512 tokens a step) and 2 decodes, in both KV flows (pull
after prefill; layer-wise, read while prefill computes): greedy output equals monolithic vLLM token
for token; the transport shows in the kv.transfer span and the Prometheus `transport` label; the
wrong-KV control (KV altered between producer and consumer changes the output when the checksum is
off, and is caught and recomputed when on); and a peer SIGKILLed in the middle of a read. The kill
tests run last: the module keeps its cluster."""

from __future__ import annotations

import asyncio
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdmesh.client import generate, make_request
from pdmesh.cluster import LocalCluster
from pdmesh.telemetry.tracing import CLIENT_REQUEST_ID_KEY
from tests.e2e.conftest import KV_TRANSPORTS, LAYERWISE_SEED, MAX_TOKENS, PROMPT_LENGTHS, assert_nothing_pinned, \
    in_process_gateway, kill_prompts, settled_stats, tamper_prompts, telemetry_flags, token_prompts, worker_stats
from tests.e2e.greedy import assert_greedy_tokens_equal

pytestmark = pytest.mark.vllm
# prompts past 512 tokens take several steps; each layer is announced to a layer-wise reader (the tiny
# model's are far below the default --layerwise_read_bytes; test_mesh_layerwise runs with the default)
CHUNKED_PREFILL = ["--engine.max_num_batched_tokens", "512", "--layerwise_read_bytes", "0"]
STALL_S = 3.0
FAULT_ARGS = ["--kv_faults.tamper_request_prefix", "tamper-",
              "--kv_faults.unverified_request_prefix", "tamper-unverified-",
              "--kv_faults.stall_request_prefix", "stall-", "--kv_faults.stall_s", str(STALL_S),
              "--kv_faults.slow_prefill_request_prefix", "slow-", "--kv_faults.slow_step_s", "0.25",
              "--pull_timeout_s", "6"]  # a read from a dead peer fails within 6 s (Mooncake's floor: 5)


@pytest.fixture(scope="module", params=KV_TRANSPORTS)
def mesh(request, tiny_llama_dir, reference, otlp_receiver, tmp_path_factory):
    transport = request.param
    with LocalCluster(tiny_llama_dir, tmp_path_factory.mktemp(f"cluster-{transport}"), num_decode=2,
                      worker_args=["--kv_transport", transport, "--mooncake_host", "127.0.0.1", *FAULT_ARGS],
                      prefill_args=CHUNKED_PREFILL,
                      telemetry_args=telemetry_flags(otlp_receiver.endpoint)) as running:
        running.killed = []
        yield transport, running
        if not running.killed:
            assert_nothing_pinned(running)


async def test_greedy_tokens_equal_monolithic_on_each_transport(mesh, reference):
    transport, cluster = mesh
    results = await asyncio.gather(*(generate(cluster.gateway_address, make_request(p, max_tokens=MAX_TOKENS))
                                     for p in token_prompts()))
    for index, (token_ids, _, last) in enumerate(results):
        assert_greedy_tokens_equal(token_ids, reference["runs"][0], index)
    assert sum(last.transfer.num_blocks for _, _, last in results) > 0
    last_index = len(token_prompts()) - 1
    again = await generate(cluster.gateway_address, make_request(token_prompts()[last_index], max_tokens=MAX_TOKENS))
    assert_greedy_tokens_equal(again[0], reference["runs"][0], last_index)   # one at a time too


async def test_layerwise_greedy_tokens_equal_monolithic_on_each_transport(mesh, reference, tiny_llama_dir):
    """Decode reserves its blocks first and reads each layer while prefill (chunked past 512 tokens)
    computes the next: the same tokens as monolithic vLLM, 1 token to many blocks plus a remainder."""
    transport, cluster = mesh
    expected = reference["runs"][10]["token_ids"]
    prompts = token_prompts(LAYERWISE_SEED)  # in no prefix cache yet: every block is read
    async with in_process_gateway(cluster, tiny_llama_dir, kv_flow="layerwise") as address:
        results = await asyncio.gather(*(generate(address, make_request(p, max_tokens=MAX_TOKENS)) for p in prompts))
        # alone, links warm: its first chunks' layers are read while the later chunks compute (each step made
        # 0.25 s slower, so a busy machine delaying decode by a few steps still sees the overlap)
        _, _, alone = await generate(address, make_request(token_prompts(LAYERWISE_SEED + 1)[-1], max_tokens=2,
                                                           request_id=f"slow-alone-{transport}"))
    for (token_ids, _, last), want, length in zip(results, expected, PROMPT_LENGTHS):
        assert token_ids == want, f"{transport}: prompt of {length} tokens diverged"
    transfers = [last.transfer for _, _, last in results]
    assert all(t.layerwise for t in transfers if t.num_blocks)
    assert [t.num_blocks for t in transfers] == [-(-n // 32) for n in PROMPT_LENGTHS]  # every block read
    assert alone.transfer.seconds_before_prefill_done > 0 and 0 < alone.transfer.overlap_ratio < 1
    stats = await settled_stats(cluster.prefill_addresses[0])  # every transfer released
    assert (stats.num_held_transfers, stats.num_expired_transfers) == (0, 0)


async def test_layerwise_reads_show_in_the_span_and_the_overlap_histogram(mesh, otlp_receiver, tiny_llama_dir):
    transport, cluster = mesh
    request_id = f"layerwise-labelled-{transport}"
    overlap = ("pdmesh_kv_overlap_ratio_count", (("role", "decode"), ("transport", transport)))

    def observed() -> float:
        return sum(_scrape(cluster.metrics_addresses[f"decode-{i}"]).get(overlap, 0) for i in range(2))

    before = observed()
    prompt = [0] + [(i * 17 + len(transport)) % 1000 + 3 for i in range(99)]  # 4 blocks, sent by no other test
    async with in_process_gateway(cluster, tiny_llama_dir, kv_flow="layerwise") as address:
        _, _, last = await generate(address, make_request(prompt, max_tokens=2, request_id=request_id))

    def mine(spans):
        return [s for s in spans if s.name == "kv.transfer" and s.attributes.get(CLIENT_REQUEST_ID_KEY) == request_id]

    (span,) = mine(otlp_receiver.wait_for(lambda spans: mine(spans)))
    attributes = span.attributes
    assert (attributes["pdmesh.kv.transport"], attributes["pdmesh.kv.layerwise"]) == (transport, True)
    if transport == "mooncake" and attributes["pdmesh.kv.checksum"] == "error":
        return  # a Mooncake TCP read timed out (see the label test): decode recomputed, nothing to observe
    assert attributes["pdmesh.kv.checksum"] == "ok"
    assert attributes["pdmesh.kv.layer_reads"] >= 1 and attributes["pdmesh.kv.bytes"] == last.transfer.num_bytes
    assert attributes["pdmesh.kv.overlap_ratio"] == pytest.approx(last.transfer.overlap_ratio)
    assert (attributes["pdmesh.kv.seconds_before_prefill_done"] + attributes["pdmesh.kv.seconds_after_prefill_done"]
            > 0)
    assert observed() - before == 1


async def test_layerwise_altered_kv_changes_the_output_unchecked_and_is_recomputed_when_checked(
        mesh, reference, tiny_llama_dir):
    """The wrong-KV control in the layer-wise flow: blocks altered as they land are caught by the
    checksum and recomputed; unchecked, they change the output."""
    transport, cluster = mesh
    index = KV_TRANSPORTS.index(transport)
    wants = reference["runs"][11]["token_ids"][2 * index:2 * index + 2]
    unchecked, checked = tamper_prompts(f"layerwise-{transport}")
    async with in_process_gateway(cluster, tiny_llama_dir, kv_flow="layerwise") as address:
        before = await _failed_blocks(cluster)
        token_ids, _, last = await generate(address, make_request(
            checked, max_tokens=MAX_TOKENS, request_id=f"tamper-layerwise-{transport}"))
        assert token_ids == wants[1]
        assert await _failed_blocks(cluster) - before == -(-len(checked) // 32)  # every block refused
        assert (last.transfer.num_blocks, last.transfer.layerwise) == (0, True)
        token_ids, _, last = await generate(address, make_request(
            unchecked, max_tokens=MAX_TOKENS, request_id=f"tamper-unverified-layerwise-{transport}"))
    if transport == "mooncake" and last.transfer.num_blocks == 0:
        pytest.skip("Mooncake's TCP transport timed this read out (see the label test): nothing landed to alter")
    assert last.transfer.num_blocks > 0
    assert token_ids != wants[0], f"{transport}: altered KV left the output unchanged: the control proves nothing"


def _scrape(address: str) -> dict:
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


async def test_the_transport_is_in_the_span_and_the_metric_label(mesh, otlp_receiver):
    transport, cluster = mesh
    request_id = f"labelled-{transport}"
    received = ("pdmesh_kv_transfer_bytes_total", (("direction", "received"), ("role", "decode"), ("transport", transport)))
    sent = ("pdmesh_kv_transfer_bytes_total", (("direction", "sent"), ("role", "prefill"), ("transport", transport)))

    def totals() -> tuple[float, float]:
        decodes = sum(_scrape(cluster.metrics_addresses[f"decode-{i}"]).get(received, 0) for i in range(2))
        return decodes, _scrape(cluster.metrics_addresses["prefill-0"]).get(sent, 0)

    before = totals()
    prompt = [0] + [(i * 13 + len(transport)) % 1000 + 3 for i in range(99)]  # 4 blocks, sent by no other test
    _, _, last = await generate(cluster.gateway_address, make_request(prompt, max_tokens=2, request_id=request_id))

    def mine(spans):
        return [s for s in spans if s.name == "kv.transfer" and s.attributes.get(CLIENT_REQUEST_ID_KEY) == request_id]

    (span,) = mine(otlp_receiver.wait_for(lambda spans: mine(spans)))
    assert span.attributes["pdmesh.kv.transport"] == transport
    if transport == "mooncake" and span.attributes["pdmesh.kv.checksum"] == "error":
        # Seen here while reads waited in the engine's own blocking call, which spins a core: beside
        # three spinning vLLM engines on two cores its TCP threads starved and small reads timed out
        # (kvcache-ai/Mooncake#4209 reports similar TCP failures on 0.3.13). The reader now polls
        # with a sleep and the last runs saw none; a read that does fail is safe: decode recomputes.
        assert (last.transfer.num_bytes, span.attributes["pdmesh.kv.failed_blocks"]) == (0, 4)
        return
    assert span.attributes["pdmesh.kv.checksum"] == "ok"
    assert last.transfer.num_bytes == 4 * 131072
    assert span.attributes["pdmesh.kv.bytes"] == last.transfer.num_bytes
    after = totals()
    assert (after[0] - before[0], after[1] - before[1]) == (last.transfer.num_bytes, last.transfer.num_bytes)


async def test_altered_kv_changes_the_output_unchecked_and_is_recomputed_when_checked(mesh, reference):
    """Proof the equivalence test can fail: the same alteration, with the checksum off, gives other
    tokens; with it on, every altered block is refused and recomputed, and the tokens are right."""
    transport, cluster = mesh
    index = KV_TRANSPORTS.index(transport)
    wants = reference["runs"][8]["token_ids"][2 * index:2 * index + 2]
    unchecked, checked = tamper_prompts(transport)
    before = await _failed_blocks(cluster)
    token_ids, _, last = await generate(cluster.gateway_address, make_request(
        checked, max_tokens=MAX_TOKENS, request_id=f"tamper-{transport}"))
    assert token_ids == wants[1]
    assert await _failed_blocks(cluster) - before == -(-len(checked) // 32)  # every block refused
    assert last.transfer.num_blocks == 0
    middle = await _failed_blocks(cluster)
    token_ids, _, last = await generate(cluster.gateway_address, make_request(
        unchecked, max_tokens=MAX_TOKENS, request_id=f"tamper-unverified-{transport}"))
    if transport == "mooncake" and last.transfer.num_blocks == 0:
        pytest.skip("Mooncake's TCP transport timed this read out (see the label test): nothing landed to alter")
    assert last.transfer.num_blocks > 0
    assert token_ids != wants[0], f"{transport}: altered KV left the output unchanged: the control proves nothing"
    assert await _failed_blocks(cluster) == middle


async def _failed_blocks(cluster: LocalCluster) -> int:
    live = [address for address in cluster.decode_addresses if address not in cluster.killed]
    return sum(stats.kv_failed_blocks for stats in await asyncio.gather(*(worker_stats(a) for a in live)))


async def _until_read_started(cluster: LocalCluster, blocks_sent_before: int, timeout_s: float = 20.0) -> None:
    """Until the prefill has handed out blocks (opened the transfer, or sent its first message):
    the reading decode is then in its stall."""
    deadline = time.monotonic() + timeout_s
    while (await worker_stats(cluster.prefill_addresses[0])).kv_blocks_sent == blocks_sent_before:
        assert time.monotonic() < deadline, "no decode started reading"
        await asyncio.sleep(0.05)


def _kill(cluster: LocalCluster, address: str) -> None:
    cluster.kill(cluster.worker_names[address])
    cluster.killed.append(address)


async def test_decode_killed_mid_read_is_retried_on_another_and_the_prefill_frees_its_blocks(
        mesh, reference, tiny_llama_dir):
    transport, cluster = mesh
    want = reference["runs"][9]["token_ids"][2 * KV_TRANSPORTS.index(transport)]
    request = make_request(kill_prompts(transport)[0], max_tokens=MAX_TOKENS, request_id=f"stall-decode-{transport}")
    async with in_process_gateway(cluster, tiny_llama_dir, with_gateway=True) as (gateway, address):
        sent_before = (await worker_stats(cluster.prefill_addresses[0])).kv_blocks_sent
        running = asyncio.create_task(generate(address, request))
        await _until_read_started(cluster, sent_before)
        (victim,) = [worker.address for worker in gateway.pool.workers("decode") if worker.in_flight]
        _kill(cluster, victim)  # inside the read's stall: opened, not yet moved
        token_ids, _, last = await running
    assert token_ids == want
    assert last.transfer.num_failovers == 1 and last.transfer.decode_worker != victim
    deadline = time.monotonic() + 10
    while (await worker_stats(cluster.prefill_addresses[0])).num_held_transfers and time.monotonic() < deadline:
        await asyncio.sleep(0.1)  # the gateway releases the first attempt's transfer in the background
    assert (await worker_stats(cluster.prefill_addresses[0])).num_held_transfers == 0


async def test_prefill_killed_mid_read_leaves_decode_serving_the_right_tokens(mesh, reference):
    """A Mooncake read fails (at once, or at the 6 s pull timeout) and decode recomputes the
    blocks; shared memory outlives its producer (the mapping keeps the pages), so that read completes;
    a gRPC read completes if the rest of the stream was already in the socket's buffers (16 blocks
    here), else fails and decode recomputes."""
    transport, cluster = mesh
    want = reference["runs"][9]["token_ids"][2 * KV_TRANSPORTS.index(transport) + 1]
    before = await _failed_blocks(cluster)
    sent_before = (await worker_stats(cluster.prefill_addresses[0])).kv_blocks_sent
    request = make_request(kill_prompts(transport)[1], max_tokens=MAX_TOKENS, request_id=f"stall-prefill-{transport}")
    running = asyncio.create_task(generate(cluster.gateway_address, request))
    await _until_read_started(cluster, sent_before)
    _kill(cluster, cluster.prefill_addresses[0])
    started = time.monotonic()
    token_ids, _, last = await running
    assert token_ids == want
    assert time.monotonic() - started < STALL_S + 8
    failed = await _failed_blocks(cluster) - before
    if transport == "shm":
        assert (failed, last.transfer.num_blocks) == (0, 16)
    elif transport == "mooncake":
        assert failed > 0 and last.transfer.num_blocks + failed == 16
    else:
        assert last.transfer.num_blocks + failed == 16

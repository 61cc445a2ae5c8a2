"""Scheduler-side decisions with stand-in requests and blocks (the e2e tests drive real vLLM)."""

import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from vllm.v1.request import RequestStatus

from kvstore.store_lookup import AsyncStoreLookup
from pdmesh.kv import params as kvp
from pdmesh.kv.block_hash import chain_block_hashes, salt_extra_key
from worker.compute_rate import ComputeRate, LoadBudget
from worker.metadata import PDMeshWorkerMeta
from worker.scheduler_side import ConnectorScheduler

BLOCK_SIZE = 32
SEED = b"model-fingerprint"
RATE_ONLY = {kvp.PREFILL_TOKENS_PER_S: 5000.0, kvp.DECODE_STEP_S: 0.0}   # every finished request's params: the rates


def _names(token_ids, cache_salt: str = "") -> list[bytes]:
    """The chained names of the blocks holding token_ids (the partial last one too)."""
    return chain_block_hashes(SEED, token_ids, BLOCK_SIZE, salt_extra_key(cache_salt), include_partial=True)


@dataclass
class _Request:
    request_id: str
    prompt_token_ids: list[int]
    kv_transfer_params: dict | None
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass
class _Blocks:
    ids: list[int] = field(default_factory=list)

    def get_block_ids(self):
        return (self.ids,)


def _decode_request(num_tokens: int) -> _Request:
    handle = kvp.KVHandle("p-1", "127.0.0.1:9", (10, 11, 12, 13), num_tokens)
    params = {kvp.DO_REMOTE_PREFILL: True, kvp.PDMESH_REQUEST_ID: "mesh-1", **kvp.handle_params(handle)}
    return _Request("d-1", list(range(num_tokens)), params)


def test_consumer_claims_all_remote_tokens_beyond_the_local_hit():
    sched = ConnectorScheduler(BLOCK_SIZE, "127.0.0.1:1", SEED)
    assert sched.get_num_new_matched_tokens(_decode_request(100), 0) == (100, True)
    assert sched.get_num_new_matched_tokens(_decode_request(100), 64) == (36, True)
    assert sched.get_num_new_matched_tokens(_decode_request(64), 64) == (0, False)


def test_consumer_pulls_only_blocks_past_the_local_prefix_hit():
    sched = ConnectorScheduler(BLOCK_SIZE, "127.0.0.1:1", SEED)
    request = _decode_request(100)
    sched.update_state_after_alloc(request, _Blocks([20, 21, 22, 23]), num_external_tokens=36)
    (task,) = sched.build_connector_meta().recvs
    assert (task.block_indexes, task.local_block_ids) == ([2, 3], [22, 23])
    assert (task.transfer_id, task.pdmesh_request_id, task.report_done) == ("p-1", "mesh-1", True)
    assert task.token_ids == list(range(100))
    assert request.kv_transfer_params[kvp.DO_REMOTE_PREFILL] is False
    sched.update_state_after_alloc(request, _Blocks([20, 21, 22, 23]), num_external_tokens=36)
    assert sched.build_connector_meta().recvs == []  # one transfer per request


def test_full_local_hit_still_releases_the_producer_blocks():
    sched = ConnectorScheduler(BLOCK_SIZE, "127.0.0.1:1", SEED)
    sched.update_state_after_alloc(_decode_request(64), _Blocks([1, 2]), num_external_tokens=0)
    (task,) = sched.build_connector_meta().recvs
    assert (task.block_indexes, task.report_done, task.transfer_id) == ([], False, "p-1")


def test_handle_with_too_few_blocks_is_recomputed_not_loaded():
    request = _decode_request(200)  # needs 7 blocks, the handle names 4
    assert ConnectorScheduler(BLOCK_SIZE, "x", SEED).get_num_new_matched_tokens(request, 0) == (0, False)


def test_producer_pins_finished_blocks_and_returns_a_handle():
    sched = ConnectorScheduler(BLOCK_SIZE, "127.0.0.1:7", SEED)
    request = _Request("p-1", list(range(40)), kvp.prefill_params("mesh-1"),
                       status=RequestStatus.FINISHED_LENGTH_CAPPED, num_computed_tokens=40)
    delay_free, handle = sched.request_finished(request, ([5, 8],))
    assert delay_free is True
    minted = kvp.KVHandle.from_params(handle)
    assert (minted.kv_address, minted.block_ids, minted.num_tokens) == ("127.0.0.1:7", (5, 8), 40)
    assert handle[kvp.LOADED_FROM_STORE] is False
    (send,) = sched.build_connector_meta().sends
    assert (send.transfer_id, send.block_ids, send.token_ids) == (minted.transfer_id, [5, 8], list(range(40)))


def test_transfer_ids_are_minted_unguessable_not_the_request_id():
    sched = ConnectorScheduler(BLOCK_SIZE, "127.0.0.1:7", SEED)
    ids = set()
    for _ in range(2):
        request = _Request("p-1", list(range(40)), kvp.prefill_params("mesh-1"),
                           status=RequestStatus.FINISHED_LENGTH_CAPPED, num_computed_tokens=40)
        ids.add(kvp.KVHandle.from_params(sched.request_finished(request, ([5, 8],))[1]).transfer_id)
    assert len(ids) == 2 and "p-1" not in ids and "mesh-1" not in ids
    assert all(len(transfer_id) >= 24 for transfer_id in ids)  # 18 random bytes, base64


def test_layerwise_producer_holds_under_the_transfer_id_its_consumer_already_has():
    sched = ConnectorScheduler(BLOCK_SIZE, "127.0.0.1:7", SEED)
    request = _Request("p-1", list(range(40)), kvp.prefill_params("mesh-1", layerwise_transfer_id="t" * 24),
                       status=RequestStatus.FINISHED_LENGTH_CAPPED, num_computed_tokens=40)
    sched.update_state_after_alloc(request, _Blocks([5, 8]), num_external_tokens=0)
    _, handle = sched.request_finished(request, ([5, 8],))
    assert kvp.KVHandle.from_params(handle).transfer_id == "t" * 24
    meta = sched.build_connector_meta()
    assert ([send.transfer_id for send in meta.sends], meta.layerwise_ended) == (["t" * 24], [])


def test_layerwise_producer_aborted_ends_its_transfer_for_the_reading_consumer():
    sched = ConnectorScheduler(BLOCK_SIZE, "x", SEED)
    request = _Request("p-1", [1, 2], kvp.prefill_params("m", layerwise_transfer_id="t" * 24),
                       status=RequestStatus.FINISHED_ABORTED, num_computed_tokens=2)
    assert sched.request_finished(request, ([5],)) == (False, RATE_ONLY)
    meta = sched.build_connector_meta()
    assert (meta.sends, meta.layerwise_ended) == ([], ["t" * 24])


def test_layerwise_consumer_reserves_its_blocks_before_any_producer_block_is_named():
    sched = ConnectorScheduler(BLOCK_SIZE, "x", SEED)
    handle = kvp.KVHandle("t" * 24, "127.0.0.1:9", (), 100, layerwise=True)
    request = _Request("d-1", list(range(100)),
                       {kvp.DO_REMOTE_PREFILL: True, kvp.PDMESH_REQUEST_ID: "mesh-1", **kvp.handle_params(handle)})
    assert sched.get_num_new_matched_tokens(request, 0) == (100, True)
    sched.update_state_after_alloc(request, _Blocks([20, 21, 22, 23]), num_external_tokens=100)
    (task,) = sched.build_connector_meta().recvs
    assert (task.layerwise, task.block_indexes, task.local_block_ids) == (True, [0, 1, 2, 3], [20, 21, 22, 23])


def test_producer_frees_aborted_requests_at_once():
    sched = ConnectorScheduler(BLOCK_SIZE, "x", SEED)
    request = _Request("p-1", [1, 2], kvp.prefill_params("m"), status=RequestStatus.FINISHED_ABORTED,
                       num_computed_tokens=2)
    assert sched.request_finished(request, ([5],)) == (False, RATE_ONLY)
    assert sched.build_connector_meta().sends == []


def test_consumer_aborted_before_allocation_releases_the_producer():
    sched = ConnectorScheduler(BLOCK_SIZE, "x", SEED)
    request = _decode_request(50)
    request.status = RequestStatus.FINISHED_ABORTED
    assert sched.request_finished(request, ([],)) == (False, RATE_ONLY)
    (task,) = sched.build_connector_meta().recvs
    assert (task.block_indexes, task.report_done) == ([], False)


class _FakeLookup:
    """Stands in for the worker's KVStore service (tests/kvstore/test_store_agent.py and
    tests/e2e/test_mesh_kvstore.py drive the real one); `answer` lets a test hold the reply back."""

    def __init__(self, nodes: list[str]) -> None:
        self.nodes = nodes
        self.calls: list[tuple[int, list[bytes]]] = []
        self.answer = threading.Event()
        self.answer.set()

    def nodes_of_cached_prefix(self, prompt_token_ids, block_hashes) -> list[str]:
        self.calls.append((len(prompt_token_ids), block_hashes))
        assert self.answer.wait(10)
        return self.nodes

    def close(self) -> None:
        pass


def _scheduler(lookup: _FakeLookup | None, kv_address: str = "127.0.0.1:1") -> ConnectorScheduler:
    return ConnectorScheduler(BLOCK_SIZE, kv_address, SEED, AsyncStoreLookup(lookup, max_wait_s=30) if lookup else None)


def _matched(sched: ConnectorScheduler, request, num_computed_tokens: int) -> tuple[int, bool]:
    """What the scheduler answers once the store lookup is in (vLLM asks again each step)."""
    deadline = time.monotonic() + 10
    while (answer := sched.get_num_new_matched_tokens(request, num_computed_tokens))[0] is None:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    return answer


def _prefill_request(num_tokens: int, cache_salt: str | None = None) -> _Request:
    request = _Request("p-1", list(range(num_tokens)), kvp.prefill_params("mesh-1", {"traceparent": "t"}))
    request.cache_salt = cache_salt
    return request


def test_the_store_lookup_never_blocks_the_scheduler_it_answers_not_yet():
    lookup = _FakeLookup(["", ""])
    lookup.answer.clear()  # the worker's store is slow to answer
    sched = _scheduler(lookup)
    request = _prefill_request(100)
    assert sched.get_num_new_matched_tokens(request, 0) == (None, False)
    assert sched.get_num_new_matched_tokens(request, 0) == (None, False)  # asked again next step: still out
    lookup.answer.set()
    assert _matched(sched, request, 0) == (64, True)
    assert lookup.calls == [(100, _names(range(100)))]  # one lookup per request


def test_a_request_that_leaves_during_its_lookup_leaves_nothing_behind():
    lookup = _FakeLookup([""])
    lookup.answer.clear()
    sched = _scheduler(lookup)
    request = _prefill_request(100)
    assert sched.get_num_new_matched_tokens(request, 0) == (None, False)
    request.status = RequestStatus.FINISHED_ABORTED
    assert sched.request_finished(request, ([],)) == (False, RATE_ONLY)
    lookup.answer.set()
    assert sched._store.num_pending == 0 and sched._store_plans == {}


def test_producer_claims_the_store_hit_beyond_its_own_prefix_cache_and_asks_once():
    lookup = _FakeLookup(["", "", "10.0.0.2:7"])  # 3 blocks: two here, one on another node
    sched = _scheduler(lookup)
    request = _prefill_request(100, cache_salt="tenant-a")
    assert _matched(sched, request, 0) == (96, True)
    assert sched.get_num_new_matched_tokens(request, 32) == (64, True)  # asked again: same plan
    assert lookup.calls == [(100, _names(range(100), "tenant-a"))]
    sched.update_state_after_alloc(request, _Blocks([20, 21, 22, 23]), num_external_tokens=64)
    (load,) = sched.build_connector_meta().loads
    assert (load.block_indexes, load.local_block_ids, load.nodes) == ([1, 2], [21, 22], ["", "10.0.0.2:7"])
    assert (load.token_ids, load.extra_key, load.pdmesh_request_id) == (list(range(96)), b"tenant-a", "mesh-1")
    assert load.block_hashes == _names(range(96), "tenant-a")
    assert load.num_local_tokens == 32
    assert load.trace_carrier == {"traceparent": "t"}
    assert sched.get_num_new_matched_tokens(request, 0) == (0, False)  # after a (failed) load: recompute


def test_producer_reports_a_store_load_in_its_handle_and_saves_with_the_salt():
    sched = _scheduler(_FakeLookup(["", ""]), "127.0.0.1:7")
    request = _prefill_request(70, cache_salt="tenant-a")
    _matched(sched, request, 0)
    sched.update_state_after_alloc(request, _Blocks([5, 8, 9]), num_external_tokens=64)
    load_stats = {"tokens_by_tier": {"dram": 64}, "num_blocks": 2}
    sched.update_connector_output(PDMeshWorkerMeta({"p-1": load_stats}))  # the worker's step output
    request.status, request.num_computed_tokens = RequestStatus.FINISHED_LENGTH_CAPPED, 70
    _, handle = sched.request_finished(request, ([5, 8, 9],))
    assert handle[kvp.LOADED_FROM_STORE] is True
    assert handle[kvp.REQUEST_STATS] == load_stats
    (send,) = sched.build_connector_meta().sends
    assert (send.extra_key, send.pdmesh_request_id) == (b"tenant-a", "mesh-1")
    assert send.block_hashes == _names(range(70), "tenant-a")   # the partial last block too


def test_a_request_is_hashed_once_for_its_lookup_load_and_hold_then_forgotten():
    sched = _scheduler(_FakeLookup(["", ""]), "127.0.0.1:7")
    request = _prefill_request(70, cache_salt="tenant-a")
    _matched(sched, request, 0)
    sched.update_state_after_alloc(request, _Blocks([5, 8, 9]), num_external_tokens=64)
    request.status, request.num_computed_tokens = RequestStatus.FINISHED_LENGTH_CAPPED, 70
    sched.request_finished(request, ([5, 8, 9],))
    meta = sched.build_connector_meta()
    assert (meta.loads[0].block_hashes, meta.sends[0].block_hashes[:2]) == (_names(range(64), "tenant-a"),) * 2
    assert (sched._hashes.num_hashed, len(sched._hashes)) == (1, 0)


def test_a_consumer_checks_its_pull_against_the_names_of_the_tokens_it_claimed():
    sched = ConnectorScheduler(BLOCK_SIZE, "127.0.0.1:1", SEED)
    request = _decode_request(100)
    request.cache_salt = "tenant-b"
    sched.update_state_after_alloc(request, _Blocks([20, 21, 22, 23]), num_external_tokens=36)
    (task,) = sched.build_connector_meta().recvs
    assert task.block_hashes == _names(range(100), "tenant-b") != _names(range(100))


def test_no_store_hit_or_no_store_claims_nothing():
    assert _matched(_scheduler(_FakeLookup([])), _prefill_request(100), 0) == (0, False)
    assert ConnectorScheduler(BLOCK_SIZE, "x", SEED).get_num_new_matched_tokens(_prefill_request(100), 0) == (0, False)
    sched = _scheduler(_FakeLookup(["", ""]))
    assert _matched(sched, _prefill_request(100), 64) == (0, False)  # own cache has it all


def test_a_decode_requests_pull_stats_come_back_in_its_finished_params():
    sched = ConnectorScheduler(BLOCK_SIZE, "127.0.0.1:1", SEED)
    request = _decode_request(96)
    sched.get_num_new_matched_tokens(request, 0)
    sched.update_state_after_alloc(request, _Blocks([1, 2, 3]), num_external_tokens=95)
    pull_stats = {"num_blocks": 3, "num_bytes": 3 * 4096, "seconds": 0.01}
    sched.update_connector_output(PDMeshWorkerMeta({"d-1": pull_stats}))
    sched.update_connector_output(None)  # steps without worker metadata change nothing
    request.status = RequestStatus.FINISHED_LENGTH_CAPPED
    assert sched.request_finished(request, ([1, 2, 3],)) == (False, {kvp.REQUEST_STATS: pull_stats, **RATE_ONLY})
    assert sched.request_finished(request, ([1, 2, 3],)) == (False, RATE_ONLY)  # handed out once


def test_a_pull_flow_transfer_id_is_minted_when_first_scheduled_and_told_the_workers_before_its_handle_leaves():
    """The producer's workers know the id from the step that computes the request on, so a read that
    reaches them before the hold (a step after the request finished) waits for it; any other id is
    refused at once."""
    sched = ConnectorScheduler(BLOCK_SIZE, "127.0.0.1:7", SEED)
    request = _Request("p-1", list(range(40)), kvp.prefill_params("mesh-1"), num_computed_tokens=40)
    sched.update_state_after_alloc(request, _Blocks([5, 8]), num_external_tokens=0)
    assert sched.has_work_for_workers()
    (minted,) = sched.build_connector_meta().minted_transfer_ids
    sched.update_state_after_alloc(request, _Blocks([5, 8]), num_external_tokens=0)  # resumed after a preemption
    assert sched.build_connector_meta().minted_transfer_ids == []
    request.status = RequestStatus.FINISHED_LENGTH_CAPPED
    _, handle = sched.request_finished(request, ([5, 8],))
    assert kvp.KVHandle.from_params(handle).transfer_id == minted and len(minted) >= 24
    meta = sched.build_connector_meta()
    assert ([send.transfer_id for send in meta.sends], meta.unheld_transfer_ids) == ([minted], [])


def test_a_minted_transfer_id_whose_request_ends_without_a_handover_is_dropped_by_the_workers():
    sched = ConnectorScheduler(BLOCK_SIZE, "x", SEED)
    request = _Request("p-1", [1, 2], kvp.prefill_params("m"), num_computed_tokens=2)
    sched.update_state_after_alloc(request, _Blocks([5]), num_external_tokens=0)
    (minted,) = sched.build_connector_meta().minted_transfer_ids
    request.status = RequestStatus.FINISHED_ABORTED
    assert sched.request_finished(request, ([5],)) == (False, RATE_ONLY)
    meta = sched.build_connector_meta()
    assert (meta.sends, meta.unheld_transfer_ids) == ([], [minted])


def test_layerwise_and_decode_requests_mint_no_transfer_id():
    sched = ConnectorScheduler(BLOCK_SIZE, "x", SEED)
    layerwise = _Request("p-1", [1, 2], kvp.prefill_params("m", layerwise_transfer_id="t" * 24))
    sched.update_state_after_alloc(layerwise, _Blocks([5]), num_external_tokens=0)
    sched.update_state_after_alloc(_decode_request(64), _Blocks([1, 2]), num_external_tokens=0)
    assert sched.build_connector_meta().minted_transfer_ids == []


def test_the_prompt_rate_and_step_time_are_measured_on_the_steps_and_returned_with_every_finished_request():
    sched = ConnectorScheduler(BLOCK_SIZE, "x", SEED, compute_rate=ComputeRate(1000.0, alpha=1.0))
    sched.compute_rate.on_step(2000, now=10.0)   # a 2,000-token step that took 0.5 s
    sched.compute_rate.on_step(0, now=10.5)
    sched.decode_step_time.on_step(3, now=10.5)
    sched.decode_step_time.on_step(3, now=10.52)   # decoding 3 streams: 20 ms a step
    request = _Request("l-1", [1, 2], None, status=RequestStatus.FINISHED_LENGTH_CAPPED)  # served whole here
    delay_free, params = sched.request_finished(request, ([5],))
    assert (delay_free, params[kvp.PREFILL_TOKENS_PER_S]) == (False, 4000.0)
    assert params[kvp.DECODE_STEP_S] == pytest.approx(0.02)


def test_every_scheduled_step_times_the_decoding_steps():
    sched = ConnectorScheduler(BLOCK_SIZE, "x", SEED)
    for _ in range(3):
        sched.build_connector_meta(SimpleNamespace(total_num_scheduled_tokens=2, num_scheduled_tokens={"a": 1, "b": 1},
                                                   scheduled_cached_reqs=SimpleNamespace(req_ids=["a", "b"])))
    assert sched.decode_step_time.num_samples == 2 and 0 < sched.decode_step_time.step_s < 2.0


def test_a_store_load_is_budgeted_at_the_measured_rate():
    sched = ConnectorScheduler(BLOCK_SIZE, "x", SEED, AsyncStoreLookup(_FakeLookup(["", "", ""]), max_wait_s=30),
                               compute_rate=ComputeRate(6400.0), load_budget=LoadBudget(factor=2.0, min_s=0.01))
    request = _prefill_request(100)
    _matched(sched, request, 0)
    sched.update_state_after_alloc(request, _Blocks([20, 21, 22, 23]), num_external_tokens=64)
    (load,) = sched.build_connector_meta().loads
    assert load.budget_s == 2.0 * 64 / 6400.0   # its 2 blocks' tokens at the rate, times the factor

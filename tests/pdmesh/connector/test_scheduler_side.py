"""Scheduler-side decisions with stand-in requests and blocks (the e2e tests drive real vLLM)."""

from dataclasses import dataclass, field

from vllm.v1.request import RequestStatus

from pdmesh.connector import params as kvp
from pdmesh.connector.scheduler_side import ConnectorScheduler

BLOCK_SIZE = 32


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
    params = {kvp.DO_REMOTE_PREFILL: True, kvp.PDMESH_REQUEST_ID: "mesh-1", "transfer_id": "p-1",
              "kv_address": "127.0.0.1:9", "block_ids": [10, 11, 12, 13], "num_tokens": num_tokens}
    return _Request("d-1", list(range(num_tokens)), params)


def test_consumer_claims_all_remote_tokens_beyond_the_local_hit():
    sched = ConnectorScheduler(BLOCK_SIZE, "127.0.0.1:1")
    assert sched.get_num_new_matched_tokens(_decode_request(100), 0) == (100, True)
    assert sched.get_num_new_matched_tokens(_decode_request(100), 64) == (36, True)
    assert sched.get_num_new_matched_tokens(_decode_request(64), 64) == (0, False)


def test_consumer_pulls_only_blocks_past_the_local_prefix_hit():
    sched = ConnectorScheduler(BLOCK_SIZE, "127.0.0.1:1")
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
    sched = ConnectorScheduler(BLOCK_SIZE, "127.0.0.1:1")
    sched.update_state_after_alloc(_decode_request(64), _Blocks([1, 2]), num_external_tokens=0)
    (task,) = sched.build_connector_meta().recvs
    assert (task.block_indexes, task.report_done, task.transfer_id) == ([], False, "p-1")


def test_handle_with_too_few_blocks_is_recomputed_not_loaded():
    request = _decode_request(200)  # needs 7 blocks, the handle names 4
    assert ConnectorScheduler(BLOCK_SIZE, "x").get_num_new_matched_tokens(request, 0) == (0, False)


def test_producer_pins_finished_blocks_and_returns_a_handle():
    sched = ConnectorScheduler(BLOCK_SIZE, "127.0.0.1:7")
    request = _Request("p-1", list(range(40)), kvp.prefill_params("mesh-1"),
                       status=RequestStatus.FINISHED_LENGTH_CAPPED, num_computed_tokens=40)
    delay_free, handle = sched.request_finished(request, ([5, 8],))
    assert delay_free is True
    assert handle == {"transfer_id": "p-1", "kv_address": "127.0.0.1:7", "block_ids": [5, 8], "num_tokens": 40,
                      kvp.LOADED_FROM_STORE: False}
    (send,) = sched.build_connector_meta().sends
    assert (send.transfer_id, send.block_ids, send.token_ids) == ("p-1", [5, 8], list(range(40)))


def test_producer_frees_aborted_requests_at_once():
    sched = ConnectorScheduler(BLOCK_SIZE, "x")
    request = _Request("p-1", [1, 2], kvp.prefill_params("m"), status=RequestStatus.FINISHED_ABORTED,
                       num_computed_tokens=2)
    assert sched.request_finished(request, ([5],)) == (False, None)
    assert sched.build_connector_meta().sends == []


def test_consumer_aborted_before_allocation_releases_the_producer():
    sched = ConnectorScheduler(BLOCK_SIZE, "x")
    request = _decode_request(50)
    request.status = RequestStatus.FINISHED_ABORTED
    assert sched.request_finished(request, ([],)) == (False, None)
    (task,) = sched.build_connector_meta().recvs
    assert (task.block_indexes, task.report_done) == ([], False)

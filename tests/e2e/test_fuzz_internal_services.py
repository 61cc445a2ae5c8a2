"""Property-based fuzzing of the internal services a mesh peer calls (Prefill, Decode, KVTransfer,
KVStore) on the session's real workers: malformed or foreign requests (random transfer ids,
another model's CompatInfo, out-of-vocabulary tokens, bad sampling, bytes that are no message)
get a client-error status with a message or a correct answer, never UNKNOWN / INTERNAL, and the
workers keep serving. Transfers a fuzzed Prefill creates are released (the session's leak check
still holds)."""

from __future__ import annotations

import uuid

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdmesh.transport.mesh_auth import MESH_TOKEN_KEY
from pdmesh.v1 import common_pb2, kv_store_pb2, kv_store_pb2_grpc, kv_transfer_pb2, kv_transfer_pb2_grpc
from pdmesh.v1 import worker_pb2, worker_pb2_grpc
from tests.e2e.conftest import sync_mesh_channel
from tests.e2e.fuzzing import (FUZZ, PROMPTS, SMALL_SAMPLING, TALLY, TOKENS, TRANSFER_IDS, client_error,
                               decode_runs_or_is_refused, kv_handles, peer_compats, prefill_runs_or_is_refused)

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def peer(cluster):
    return peer_compats(cluster.prefill_addresses[0])


def test_fuzzed_prefill_requests_are_run_or_refused(cluster):
    with sync_mesh_channel(cluster.prefill_addresses[0]) as channel:
        stub = worker_pb2_grpc.PrefillStub(channel)

        @FUZZ
        @given(tokens=TOKENS, sampling=st.one_of(st.none(), SMALL_SAMPLING), salt=st.text(max_size=10))
        def check(tokens, sampling, salt):
            request = worker_pb2.PrefillRequest(request_id=f"fuzz-{uuid.uuid4().hex}", prompt_token_ids=tokens,
                                                cache_salt=salt)
            if sampling is not None:
                request.sampling.CopyFrom(sampling)
            prefill_runs_or_is_refused(stub, request)

        check()


def test_fuzzed_decode_requests_stream_or_are_refused(cluster, peer):
    handles = kv_handles(cluster.prefill_addresses_kv[0], peer)
    with sync_mesh_channel(cluster.decode_addresses[0]) as channel:
        stub = worker_pb2_grpc.DecodeStub(channel)

        @FUZZ
        @given(tokens=PROMPTS, sampling=SMALL_SAMPLING, kv=st.one_of(st.none(), handles))
        def check(tokens, sampling, kv):
            decode_runs_or_is_refused(stub, tokens, sampling, kv)

        check()


def test_fuzzed_kv_port_calls_are_refused_without_the_token_and_answered_clearly_with_it(cluster, peer):
    compat, foreign = peer
    token = ((MESH_TOKEN_KEY, cluster.mesh_token),)
    with grpc.insecure_channel(cluster.prefill_addresses_kv[0]) as channel:
        transfer = kv_transfer_pb2_grpc.KVTransferStub(channel)
        store = kv_store_pb2_grpc.KVStoreStub(channel)
        calls = {   # by the method's name, as the report counts them
            "KVTransfer.Pull": lambda tid, c, ids: list(transfer.Pull(kv_transfer_pb2.PullRequest(
                transfer_id=tid, compat=c, block_indexes=ids), metadata=md, timeout=30)),
            "KVTransfer.Open": lambda tid, c, ids: transfer.Open(kv_transfer_pb2.OpenRequest(
                transfer_id=tid, compat=c, block_indexes=ids), metadata=md, timeout=30),
            "KVTransfer.Release": lambda tid, c, ids: transfer.Release(
                kv_transfer_pb2.ReleaseRequest(transfer_id=tid), metadata=md, timeout=30),
            "KVTransfer.Watch": lambda tid, c, ids: transfer.Watch(kv_transfer_pb2.WatchRequest(
                transfer_id=tid, compat=c, block_indexes=ids, wait_ms=10), metadata=md, timeout=30),
            "KVTransfer.Handshake": lambda tid, c, ids: transfer.Handshake(kv_transfer_pb2.HandshakeRequest(
                compat=c, transports=[tid]), metadata=md, timeout=30),
            "KVStore.Lookup": lambda tid, c, ids: store.Lookup(kv_store_pb2.LookupRequest(
                compat=c, token_ids=ids, extra_key=tid.encode()), metadata=md, timeout=30),
        }
        for md, refused in (((), grpc.StatusCode.UNAUTHENTICATED), (token, None)):

            @FUZZ
            @given(method=st.sampled_from(sorted(calls)), transfer_id=TRANSFER_IDS,
                   which=st.sampled_from(["peer", "foreign", "empty"]), ids=st.lists(st.integers(-5, 10**6),
                                                                                      max_size=6))
            def check(method, transfer_id, which, ids):
                chosen = {"peer": compat, "foreign": foreign, "empty": common_pb2.CompatInfo()}[which]
                target = method if md else f"{method} (no token)"
                try:
                    calls[method](transfer_id, chosen, ids)
                    TALLY.answered(target)
                except grpc.RpcError as error:
                    TALLY.grpc_error(target, error)
                    if refused is not None:
                        assert error.code() == refused, error
                    else:
                        assert client_error(error, grpc.StatusCode.PERMISSION_DENIED), (method, error)
                else:
                    assert refused is None, method

            check()

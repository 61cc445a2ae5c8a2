"""What the fuzz tests share: Hypothesis's bound (60 examples a property in CI; bench/fuzz.py sets
more for the report's run), the client-error statuses a fuzzed call may get, the tally of the answers
the report counts, and the strategies for sampling params, token prompts and transfer ids."""

from __future__ import annotations

import os
import uuid

import grpc
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from pdmesh.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from tests.e2e.conftest import sync_mesh_channel, token_prompts
from tests.e2e.fuzz_tally import EXAMPLES_ENV, TALLY

CLIENT_CODES = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.OUT_OF_RANGE,
                grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.RESOURCE_EXHAUSTED}
# CI: 60 examples a property, the same ones each run. The report's run: more, seeded by --hypothesis-seed.
FUZZ = settings(max_examples=int(os.environ.get(EXAMPLES_ENV, "60")), deadline=None, database=None,
                suppress_health_check=list(HealthCheck), derandomize=EXAMPLES_ENV not in os.environ)

INT32 = st.integers(-2**31, 2**31 - 1)
FLOATS = st.floats(width=32, allow_nan=True, allow_infinity=True)
SAMPLING_FIELDS = {   # each SamplingParams field's fuzzed values
    "max_tokens": st.one_of(st.integers(-3, 6), INT32),
    "temperature": st.one_of(st.sampled_from([0.0, 1.0, 2.0]), FLOATS),
    "top_p": st.one_of(st.sampled_from([0.0, 0.5, 1.0]), FLOATS), "seed": st.integers(-2**63, 2**63 - 1),
    "stop": st.lists(st.text(max_size=8), max_size=3), "ignore_eos": st.booleans()}
SAMPLING = st.builds(common_pb2.SamplingParams,
                     **{**SAMPLING_FIELDS, "seed": st.one_of(st.none(), SAMPLING_FIELDS["seed"])})
SMALL_SAMPLING = SAMPLING.map(lambda s: common_pb2.SamplingParams(
    max_tokens=max(-3, min(s.max_tokens, 4)), temperature=s.temperature, top_p=s.top_p, stop=s.stop,
    ignore_eos=s.ignore_eos, **({"seed": s.seed} if s.HasField("seed") else {})))
TOKENS = st.lists(st.one_of(st.integers(0, 1100), INT32), max_size=120)
TRANSFER_IDS = st.one_of(st.text(max_size=40), st.binary(max_size=24).map(bytes.hex))
PROMPTS = st.one_of(TOKENS, st.sampled_from(token_prompts()[:6]))   # mostly refused, and some that run


def client_error(error: grpc.RpcError, *extra: grpc.StatusCode) -> bool:
    """A client-error status (or one of `extra`) with a message: never UNKNOWN / INTERNAL."""
    return error.code() in CLIENT_CODES | set(extra) and bool(error.details())


def peer_compats(prefill_address: str) -> tuple[common_pb2.CompatInfo, common_pb2.CompatInfo]:
    """A prefill worker's compat (a peer's) and the same for another model (a foreign peer's)."""
    with sync_mesh_channel(prefill_address) as channel:
        info = worker_pb2_grpc.WorkerInfoStub(channel).GetInfo(worker_pb2.GetInfoRequest(), timeout=10)
    foreign = common_pb2.CompatInfo()
    foreign.CopyFrom(info.compat)
    foreign.model_fingerprint = "another-model"
    return info.compat, foreign


def kv_handles(kv_address: str, compats: tuple[common_pb2.CompatInfo, common_pb2.CompatInfo],
               transfer_ids: st.SearchStrategy[str] = TRANSFER_IDS,
               layerwise: bool = False) -> st.SearchStrategy[common_pb2.KVHandle]:
    """Handles naming a real KV port, a dead one or none, with a peer's, a foreign or an empty compat."""
    return st.builds(common_pb2.KVHandle, transfer_id=transfer_ids,
                     kv_address=st.sampled_from([kv_address, "127.0.0.1:1", ""]),
                     block_ids=st.lists(st.integers(-5, 10**6), max_size=8), num_tokens=st.integers(-5, 500),
                     compat=st.sampled_from([*compats, common_pb2.CompatInfo()]), tp_size=st.integers(-1, 3),
                     layerwise=st.just(layerwise))


def decode_runs_or_is_refused(stub: worker_pb2_grpc.DecodeStub, tokens: list[int],
                              sampling: common_pb2.SamplingParams, kv: common_pb2.KVHandle | None,
                              target: str = "Decode") -> None:
    """A fuzzed Decode streams to its end or fails with a client error."""
    request = worker_pb2.DecodeRequest(request_id=f"fuzz-{uuid.uuid4().hex}", prompt_token_ids=tokens,
                                       sampling=sampling, kv=kv)
    try:
        for _ in stub.Decode(request, timeout=60):
            pass
    except grpc.RpcError as error:
        TALLY.grpc_error(target, error)
        assert client_error(error), (request, error)
    else:
        TALLY.answered(target)


def prefill_runs_or_is_refused(stub: worker_pb2_grpc.PrefillStub, request: worker_pb2.PrefillRequest,
                               target: str = "Prefill") -> worker_pb2.PrefillResponse | None:
    """A fuzzed Prefill answers (its transfer released again) or fails with a client error (None)."""
    try:
        response = stub.Prefill(request, timeout=60)
    except grpc.RpcError as error:
        TALLY.grpc_error(target, error)
        assert client_error(error), (request, error)
        return None
    TALLY.answered(target)
    stub.Release(worker_pb2.ReleaseKVRequest(transfer_id=response.kv.transfer_id), timeout=10)
    return response

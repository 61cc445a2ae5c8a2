"""Property-based fuzzing of the public APIs (gRPC Generate, the OpenAI HTTP routes) against real
vLLM workers: whatever the body, the answer is a stream of tokens or a client-error status with a
message (never UNKNOWN / INTERNAL / 5xx), and afterwards the mesh still serves monolithic vLLM's
tokens. A request is valid, valid but for one fuzzed field (so every field's checks are reached), all
fuzzed, or bytes that are no message. Bounded (max_examples) so CI stays fast; each accepted request
runs at most 4 tokens. Every answer is counted (fuzz_tally) for bench/fuzz.py's report."""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.error
import urllib.request

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.server import Gateway
from pdmesh.client import make_request
from pdmesh.config import GatewaySettings
from pdmesh.transport.grpc_options import MAX_MESSAGE_NBYTES
from pdmesh.v1 import common_pb2, generate_pb2, generate_pb2_grpc
from tests.e2e.conftest import token_prompts
from tests.e2e.fuzzing import FUZZ, INT32, SAMPLING, SAMPLING_FIELDS, TALLY, client_error

pytestmark = pytest.mark.vllm
MAX_TOKENS_LIMIT = 4
PROMPT = st.one_of(st.none(), st.text(max_size=300),
                   st.lists(st.one_of(st.integers(0, 1100), INT32), max_size=200))


VALID_SAMPLING = {"max_tokens": st.integers(1, MAX_TOKENS_LIMIT), "temperature": st.floats(0, 2),
                  "top_p": st.floats(0.01, 1), "seed": st.one_of(st.none(), st.integers(0, 2**63 - 1)),
                  "stop": st.lists(st.text(min_size=1, max_size=5), max_size=2), "ignore_eos": st.booleans()}
VALID_PROMPT = st.one_of(st.text(min_size=1, max_size=200), st.lists(st.integers(3, 1000), min_size=1, max_size=50))
GENERATE_FIELDS = {"request_id": st.text(max_size=40), "model": st.sampled_from(["", "tiny-llama", "no-such-model"]),
                   "prompt": PROMPT, "cache_salt": st.text(max_size=20),
                   **{f"sampling.{name}": values for name, values in SAMPLING_FIELDS.items()}}


def _set_prompt(request: generate_pb2.GenerateRequest, prompt: str | list[int] | None) -> None:
    request.ClearField("prompt")
    if isinstance(prompt, str):
        request.text = prompt
    elif prompt is not None:
        request.token_ids.ids.extend(prompt)


def _set_field(request: generate_pb2.GenerateRequest, field: str, value) -> None:
    if field == "prompt":
        _set_prompt(request, value)
    elif field == "sampling.stop":
        del request.sampling.stop[:]
        request.sampling.stop.extend(value)
    elif field.startswith("sampling."):
        setattr(request.sampling, field.removeprefix("sampling."), value)
    else:
        setattr(request, field, value)


@st.composite
def generate_requests(draw) -> tuple[str, generate_pb2.GenerateRequest]:
    """(how it was built, the request): valid, valid but for one fuzzed field, or all fields fuzzed."""
    case = draw(st.sampled_from(["valid", "one field fuzzed", "all fields fuzzed"]))
    if case == "all fields fuzzed":
        request = generate_pb2.GenerateRequest(sampling=draw(SAMPLING))
        for field in ("request_id", "model", "prompt", "cache_salt"):
            _set_field(request, field, draw(GENERATE_FIELDS[field]))
        return case, request
    sampling = {name: draw(values) for name, values in VALID_SAMPLING.items()}
    request = generate_pb2.GenerateRequest(model=draw(st.sampled_from(["", "tiny-llama"])),
                                           sampling=common_pb2.SamplingParams(**sampling))
    _set_prompt(request, draw(VALID_PROMPT))
    if case == "valid":
        return case, request
    field = draw(st.sampled_from(sorted(GENERATE_FIELDS)))
    _set_field(request, field, draw(GENERATE_FIELDS[field]))
    return f"{field} fuzzed", request


JSON_LEAF = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(), st.text(max_size=30))
JSON_VALUE = st.recursive(JSON_LEAF, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                             st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                          max_leaves=12)
COMPLETION_FIELDS = {"model": st.one_of(st.sampled_from(["tiny-llama", ""]), JSON_VALUE),
                     "prompt": st.one_of(st.text(max_size=200), st.lists(st.integers(-5, 1100), max_size=50),
                                         JSON_VALUE),
                     "max_tokens": st.one_of(st.integers(-2, 6), JSON_VALUE), "temperature": JSON_VALUE,
                     "top_p": JSON_VALUE, "seed": JSON_VALUE, "stop": JSON_VALUE, "stream": st.booleans(),
                     "n": JSON_VALUE, "logprobs": JSON_VALUE, "unknown_field": JSON_VALUE}
CHAT_FIELDS = {**{k: v for k, v in COMPLETION_FIELDS.items() if k != "prompt"},
               "messages": st.one_of(st.lists(st.fixed_dictionaries(
                   {"role": st.sampled_from(["user", "system", "assistant", "tool", "x"]),
                    "content": st.one_of(st.text(max_size=50), JSON_VALUE)}), max_size=3), JSON_VALUE)}
VALID_BODY = {"model": st.just("tiny-llama"), "max_tokens": VALID_SAMPLING["max_tokens"],
              "temperature": VALID_SAMPLING["temperature"], "top_p": VALID_SAMPLING["top_p"],
              "seed": st.integers(0, 2**63 - 1), "stop": VALID_SAMPLING["stop"], "stream": st.booleans()}
VALID_COMPLETION = {**VALID_BODY, "prompt": VALID_PROMPT}
VALID_CHAT = {**VALID_BODY, "messages": st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant"]), "content": st.text(min_size=1, max_size=50)}),
    min_size=1, max_size=3)}
RAW_BODIES = st.one_of(st.binary(max_size=200), st.just(b"[" * 5000 + b"]" * 5000),
                       st.just(b'{"prompt": "\xff\xfe", "max_tokens": 2}'), st.just(b"{" + b'"a":' * 3 + b"1}"))


@st.composite
def _bodies(draw, valid: dict, fields: dict) -> tuple[str, bytes]:
    """(how it was built, the body): valid, valid but for one fuzzed field, all fields fuzzed, or raw bytes."""
    case = draw(st.sampled_from(["valid", "one field fuzzed", "all fields fuzzed", "raw bytes"]))
    if case == "raw bytes":
        return case, draw(RAW_BODIES)
    if case == "all fields fuzzed":
        return case, json.dumps(draw(st.fixed_dictionaries({}, optional=fields))).encode()
    prompt = {name: values for name, values in valid.items() if name in ("prompt", "messages")}
    body = draw(st.fixed_dictionaries(prompt, optional={name: v for name, v in valid.items() if name not in prompt}))
    if case == "one field fuzzed":
        field = draw(st.sampled_from(sorted(fields)))
        body[field] = draw(fields[field])
        case = f"{field} fuzzed"
    return case, json.dumps(body).encode()


@pytest.fixture(scope="module")
def gateway(cluster, tiny_llama_dir):
    """A gateway (gRPC and HTTP) in front of the session's workers, on its own thread's loop."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    settings = GatewaySettings(port=0, http_port=0, prefill_workers=cluster.prefill_addresses,
                               decode_workers=cluster.decode_addresses, tokenizer=str(tiny_llama_dir),
                               max_tokens_limit=MAX_TOKENS_LIMIT, mesh_token=cluster.mesh_token)

    async def start() -> tuple[Gateway, str]:   # gRPC's aio server belongs to the loop it is made in
        server = Gateway(settings)
        return server, await server.start()

    server, address = asyncio.run_coroutine_threadsafe(start(), loop).result(timeout=60)
    yield server, address
    asyncio.run_coroutine_threadsafe(server.stop(0), loop).result(timeout=60)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=10)


def _generate(stub, request: generate_pb2.GenerateRequest) -> tuple[list[int], grpc.RpcError | None]:
    tokens: list[int] = []
    try:
        for response in stub.Generate(request, timeout=60):
            tokens.extend(response.token_ids)
    except grpc.RpcError as exc:
        return tokens, exc
    return tokens, None


def _post(http_address: str, path: str, body: bytes) -> tuple[int, bytes]:
    request = urllib.request.Request(f"http://{http_address}{path}", data=body,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _assert_still_serving(address: str, reference: dict) -> None:
    with grpc.insecure_channel(address) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        tokens, error = _generate(stub, make_request(token_prompts()[4], max_tokens=MAX_TOKENS_LIMIT))
    assert error is None and tokens == reference["runs"][0]["token_ids"][4][:MAX_TOKENS_LIMIT]


def test_fuzzed_generate_requests_get_tokens_or_a_client_error(gateway, reference):
    _, address = gateway
    with grpc.insecure_channel(address) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)

        @FUZZ
        @given(built=generate_requests())
        def check(built):
            case, request = built
            _, error = _generate(stub, request)
            if error is None:
                TALLY.answered("Generate", case)
            else:
                TALLY.grpc_error("Generate", error, case)
                assert client_error(error), (request, error)

        check()
        raw = channel.unary_stream("/pdmesh.v1.Generation/Generate")   # bytes as they come: not a valid proto

        @FUZZ
        @given(body=st.binary(max_size=300))
        def check_raw(body):
            try:
                list(raw(body, timeout=60))
                TALLY.answered("Generate (raw bytes)")
            except grpc.RpcError as error:
                TALLY.grpc_error("Generate (raw bytes)", error)
                assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and error.details(), error

        check_raw()
    _assert_still_serving(address, reference)


@pytest.mark.parametrize("path,valid,fields", [("/v1/completions", VALID_COMPLETION, COMPLETION_FIELDS),
                                               ("/v1/chat/completions", VALID_CHAT, CHAT_FIELDS)])
def test_fuzzed_openai_bodies_get_an_answer_or_a_4xx_with_a_message(gateway, reference, path, valid, fields):
    server, address = gateway

    @FUZZ
    @given(built=_bodies(valid, fields))
    def check(built):
        case, body = built
        status, payload = _post(server.http_address, path, body)
        assert status == 200 or 400 <= status < 500, (body[:300], status, payload[:300])
        message = "" if status == 200 else json.loads(payload)["error"]["message"]
        TALLY.http_answer(f"POST {path}", status, message, case)
        assert status == 200 or message, payload

    check()
    _assert_still_serving(address, reference)


def test_oversized_messages_get_a_client_error_and_the_gateway_keeps_serving(gateway, reference):
    """A gRPC request over the mesh's message limit, an HTTP body over the gateway's: refused with a
    status and a message before anything is parsed."""
    server, address = gateway
    with grpc.insecure_channel(address) as channel:
        oversized = make_request("x" * (MAX_MESSAGE_NBYTES + 1), max_tokens=2)
        _, error = _generate(generate_pb2_grpc.GenerationStub(channel), oversized)
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in error.details(), error
    too_big = b'{"prompt": "' + b"x" * GatewaySettings().http_max_body_bytes + b'"}'
    status, payload = _post(server.http_address, "/v1/completions", too_big)
    assert (status, json.loads(payload)["error"]["code"]) == (413, 413)
    _assert_still_serving(address, reference)

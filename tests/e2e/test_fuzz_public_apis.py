"""Property-based fuzzing of the public APIs (gRPC Generate, the OpenAI HTTP routes) against real
vLLM workers: whatever the body, the answer is a stream of tokens or a client-error status with a
message (never UNKNOWN / INTERNAL / 5xx), and afterwards the mesh still serves monolithic vLLM's
tokens. Bounded (max_examples) so CI stays fast; each accepted request runs at most 4 tokens."""

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

from gateway.openai_http import MAX_BODY_BYTES
from gateway.server import Gateway
from pdmesh.client import make_request
from pdmesh.config import GatewaySettings
from pdmesh.transport.grpc_options import MAX_MESSAGE_NBYTES
from pdmesh.v1 import generate_pb2, generate_pb2_grpc
from tests.e2e.conftest import token_prompts
from tests.e2e.fuzzing import FUZZ, INT32, SAMPLING, client_error

pytestmark = pytest.mark.vllm
MAX_TOKENS_LIMIT = 4
PROMPT = st.one_of(st.none(), st.text(max_size=300),
                   st.lists(st.one_of(st.integers(0, 1100), INT32), max_size=200))


@st.composite
def generate_requests(draw) -> generate_pb2.GenerateRequest:
    request = generate_pb2.GenerateRequest(
        request_id=draw(st.text(max_size=40)), model=draw(st.sampled_from(["", "tiny-llama", "no-such-model"])),
        sampling=draw(SAMPLING), cache_salt=draw(st.text(max_size=20)))
    prompt = draw(PROMPT)
    if isinstance(prompt, str):
        request.text = prompt
    elif prompt is not None:
        request.token_ids.ids.extend(prompt)
    return request


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


def _bodies(fields: dict) -> st.SearchStrategy[bytes]:
    as_json = st.fixed_dictionaries({}, optional=fields).map(lambda body: json.dumps(body).encode())
    raw = st.one_of(st.binary(max_size=200), st.just(b"[" * 5000 + b"]" * 5000),
                    st.just(b'{"prompt": "\xff\xfe", "max_tokens": 2}'), st.just(b"{" + b'"a":' * 3 + b"1}"))
    return st.one_of(as_json, raw)


@pytest.fixture(scope="module")
def gateway(cluster, tiny_llama_dir):
    """A gateway (gRPC and HTTP) in front of the session's workers, on its own thread's loop."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    settings = GatewaySettings(port=0, http_port=0, prefill_workers=cluster.prefill_addresses,
                               decode_workers=cluster.decode_addresses, tokenizer=str(tiny_llama_dir),
                               max_tokens_limit=MAX_TOKENS_LIMIT)

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
        @given(request=generate_requests())
        def check(request):
            _, error = _generate(stub, request)
            if error is not None:
                assert client_error(error), (request, error)

        check()
        raw = channel.unary_stream("/pdmesh.v1.Generation/Generate")   # bytes as they come: not a valid proto

        @FUZZ
        @given(body=st.binary(max_size=300))
        def check_raw(body):
            try:
                list(raw(body, timeout=60))
            except grpc.RpcError as error:
                assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and error.details(), error

        check_raw()
    _assert_still_serving(address, reference)


@pytest.mark.parametrize("path,fields", [("/v1/completions", COMPLETION_FIELDS),
                                         ("/v1/chat/completions", CHAT_FIELDS)])
def test_fuzzed_openai_bodies_get_an_answer_or_a_4xx_with_a_message(gateway, reference, path, fields):
    server, address = gateway

    @FUZZ
    @given(body=_bodies(fields))
    def check(body):
        status, payload = _post(server.http_address, path, body)
        assert status == 200 or 400 <= status < 500, (body[:300], status, payload[:300])
        if status != 200:
            assert json.loads(payload)["error"]["message"], payload

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
    status, payload = _post(server.http_address, "/v1/completions", b'{"prompt": "' + b"x" * MAX_BODY_BYTES + b'"}')
    assert (status, json.loads(payload)["error"]["code"]) == (413, 413)
    _assert_still_serving(address, reference)

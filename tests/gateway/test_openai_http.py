"""The OpenAI HTTP API against a fake generator, driven by the real openai client."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import openai
import pytest

from gateway.admission import Admission
from gateway.auth import ApiKeyAuth
from gateway.chat_template import ChatTemplate
from gateway.openai_http import HttpLimits, OpenAIHttpServer
from gateway.tokenizer import PromptTokenizer
from pdmesh.config import GatewaySettings
from pdmesh.errors import Overloaded, WorkerFailed
from pdmesh.v1 import common_pb2, generate_pb2

MAX_MODEL_LEN = 128
LIMITS = HttpLimits.of(GatewaySettings())   # the defaults
LONG_PROMPT_CHARS = LIMITS.max_body_bytes // 2   # far over any context, in a body under the limit
USAGE = common_pb2.Usage(prompt_tokens=4, completion_tokens=3, total_tokens=7, cached_prompt_tokens=2)
RESPONSES = [
    generate_pb2.GenerateResponse(request_id="r", token_ids=[5, 6], text="Hello"),
    generate_pb2.GenerateResponse(request_id="r", token_ids=[7], text=" world",
                                  finish_reason=common_pb2.FINISH_REASON_LENGTH, usage=USAGE),
]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
CHAT_TEXT = "<s>system: Be brief.\n<s>user: Hi\nassistant:"


class FakeGenerator:
    """Yields fixed responses (or raises `error` after `fail_after` of them); records what it got."""

    def __init__(self, responses=RESPONSES, error: Exception | None = None, fail_after: int = 0,
                 delay_s: float = 0.0, max_in_flight: int = 256) -> None:
        self.responses, self.error, self.fail_after, self.delay_s = responses, error, fail_after, delay_s
        self.admission = Admission(max_in_flight, max_per_tenant=None)
        self.calls: list[tuple[generate_pb2.GenerateRequest, str]] = []
        self.stopped_by: str | None = None
        self.stopped = asyncio.Event()

    async def stream(self, request, tenant, timeout_s=None):
        self.calls.append((request, tenant))
        try:
            for index, response in enumerate(self.responses):
                if self.error is not None and index == self.fail_after:
                    raise self.error
                await asyncio.sleep(self.delay_s)
                yield response
        except (GeneratorExit, asyncio.CancelledError) as exc:
            self.stopped_by = type(exc).__name__
            self.stopped.set()
            raise

    async def list_models(self):
        return generate_pb2.ListModelsResponse(models=[generate_pb2.ModelCard(id="tiny", max_model_len=MAX_MODEL_LEN)])

    async def max_model_len(self):
        return MAX_MODEL_LEN

    max_tokens_limit = None

    @property
    def request(self) -> generate_pb2.GenerateRequest:
        return self.calls[-1][0]


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir):
    return PromptTokenizer(tiny_llama_dir)


@pytest.fixture
async def serve(tokenizer, tiny_llama_dir):
    """serve(generator, api_keys) -> "host:port"; every server is stopped after the test."""
    servers = []

    async def start(generator, api_keys=None):
        server = OpenAIHttpServer(generator, ApiKeyAuth(api_keys or {}), tokenizer,
                                  ChatTemplate.from_model_dir(tiny_llama_dir), LIMITS)
        servers.append(server)
        return await server.start("127.0.0.1", 0)

    yield start
    for server in servers:
        await server.stop()


@pytest.fixture
async def clients():
    """clients(address, api_key) -> AsyncOpenAI without retries; closed after the test."""
    made = []

    def make(address, api_key="sk-a"):
        made.append(openai.AsyncOpenAI(base_url=f"http://{address}/v1", api_key=api_key, max_retries=0))
        return made[-1]

    yield make
    for client in made:
        await client.close()


async def _post(address, path, body, headers=None):
    """Raw POST: (status, headers, text)."""
    async with aiohttp.ClientSession() as session:
        data = body if isinstance(body, (str, bytes)) else json.dumps(body)
        async with session.post(f"http://{address}{path}", data=data, headers=headers or {}) as response:
            return response.status, response.headers, await response.text()


def _events(sse_text: str) -> list:
    return [line.removeprefix("data: ") for line in sse_text.split("\n\n") if line]


# ---- completions ----

async def test_completion_returns_the_text_finish_reason_usage_and_ids(serve, clients, tokenizer):
    fake = FakeGenerator()
    client = clients(await serve(fake))
    completion = await client.completions.create(model="tiny", prompt="Hello world",
                                                 extra_body={"return_token_ids": True})
    assert completion.id == f"cmpl-{fake.request.request_id}"
    assert (completion.object, completion.model) == ("text_completion", "tiny")
    choice = completion.choices[0]
    assert (choice.index, choice.text, choice.finish_reason, choice.logprobs) == (0, "Hello world", "length", None)
    assert choice.token_ids == [5, 6, 7]
    assert choice.prompt_token_ids == tokenizer.encode("Hello world") == [0, 42, 884, 593]
    assert list(fake.request.token_ids.ids) == [0, 42, 884, 593]   # tokenized once, sent as ids
    assert completion.usage.model_dump(exclude_none=True) == {
        "prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7, "prompt_tokens_details": {"cached_tokens": 2}}


async def test_completion_sends_a_text_prompt_and_openai_defaults(serve, clients):
    fake = FakeGenerator()
    completion = await clients(await serve(fake)).completions.create(model="tiny", prompt="Hello world")
    assert getattr(completion.choices[0], "token_ids", None) is None
    request = fake.request
    assert (request.model, request.text, request.WhichOneof("prompt"), request.cache_salt) == (
        "tiny", "Hello world", "text", "")
    assert request.sampling == common_pb2.SamplingParams(max_tokens=16, temperature=1.0, top_p=1.0)
    assert not request.sampling.HasField("seed")


async def test_completion_sampling_fields_and_token_id_prompts(serve, clients):
    fake = FakeGenerator()
    await clients(await serve(fake)).completions.create(
        model="tiny", prompt=[[3, 4, 5]], max_tokens=5, temperature=0, top_p=0.5, seed=7, stop="x", user="u",
        extra_body={"ignore_eos": True, "cache_salt": "salt"})
    request = fake.request
    assert list(request.token_ids.ids) == [3, 4, 5]
    assert request.sampling == common_pb2.SamplingParams(max_tokens=5, temperature=0, top_p=0.5, seed=7,
                                                         stop=["x"], ignore_eos=True)
    assert request.cache_salt == "salt"
    assert not request.HasField("slo")


async def test_the_requests_slo_reaches_the_gateway(serve, clients):
    fake = FakeGenerator()
    await clients(await serve(fake)).chat.completions.create(
        model="tiny", messages=CHAT, extra_body={"slo": {"ttft_s": 1.0, "tpot_s": 0.025}})
    assert fake.request.slo == generate_pb2.Slo(ttft_s=1.0, tpot_s=0.025)


async def test_completion_with_null_max_tokens_gets_the_rest_of_the_context(serve, tokenizer):
    fake = FakeGenerator()
    address = await serve(fake)
    body = {"model": "tiny", "prompt": "Hello world", "max_tokens": None}
    status, _, _ = await _post(address, "/v1/completions", body)
    assert status == 200
    assert fake.request.sampling.max_tokens == MAX_MODEL_LEN - len(tokenizer.encode("Hello world"))


async def test_completion_stream_sends_each_chunk_then_usage_then_done(serve, clients, tokenizer):
    fake = FakeGenerator()
    stream = await clients(await serve(fake)).completions.create(
        model="tiny", prompt="Hello world", stream=True, stream_options={"include_usage": True},
        extra_body={"return_token_ids": True})
    chunks = [chunk async for chunk in stream]
    assert {chunk.id for chunk in chunks} == {f"cmpl-{fake.request.request_id}"}
    assert [c.choices[0].text for c in chunks[:2]] == ["Hello", " world"]
    assert [c.choices[0].finish_reason for c in chunks[:2]] == [None, "length"]
    assert [c.choices[0].token_ids for c in chunks[:2]] == [[5, 6], [7]]
    assert chunks[0].choices[0].prompt_token_ids == tokenizer.encode("Hello world")
    assert getattr(chunks[1].choices[0], "prompt_token_ids", None) is None
    assert [c.usage for c in chunks[:2]] == [None, None]
    assert (chunks[2].choices, chunks[2].usage.total_tokens, chunks[2].usage.prompt_tokens_details.cached_tokens) == (
        [], 7, 2)
    assert len(chunks) == 3


async def test_stream_is_server_sent_events_ending_with_done(serve):
    address = await serve(FakeGenerator())
    status, headers, text = await _post(address, "/v1/completions", {"prompt": "Hi", "stream": True})
    assert (status, headers["Content-Type"]) == (200, "text/event-stream")
    events = _events(text)
    assert events[-1] == "[DONE]" and len(events) == 3
    assert [json.loads(e)["choices"][0]["text"] for e in events[:2]] == ["Hello", " world"]
    assert "usage" not in json.loads(events[0])   # only with stream_options.include_usage
    assert json.loads(events[0])["model"] == "tiny"   # the served model when the request names none


# ---- chat ----

async def test_chat_sends_the_rendered_prompt_ids_and_the_rest_of_the_context(serve, clients, tokenizer):
    fake = FakeGenerator()
    chat = await clients(await serve(fake)).chat.completions.create(
        model="tiny", messages=CHAT, extra_body={"return_token_ids": True})
    prompt_ids = tokenizer.encode(CHAT_TEXT, add_special_tokens=False)
    assert list(fake.request.token_ids.ids) == prompt_ids and prompt_ids[0] == 0   # the template's own <s>
    assert prompt_ids.count(0) == 2
    assert fake.request.sampling.max_tokens == MAX_MODEL_LEN - len(prompt_ids)
    assert (chat.id, chat.object) == (f"chatcmpl-{fake.request.request_id}", "chat.completion")
    choice = chat.choices[0]
    assert (choice.message.role, choice.message.content, choice.finish_reason) == ("assistant", "Hello world", "length")
    assert (choice.token_ids, chat.prompt_token_ids) == ([5, 6, 7], prompt_ids)
    assert (chat.usage.prompt_tokens, chat.usage.completion_tokens, chat.usage.total_tokens) == (4, 3, 7)


async def test_chat_max_completion_tokens_wins_over_max_tokens(serve, clients):
    fake = FakeGenerator()
    await clients(await serve(fake)).chat.completions.create(
        model="tiny", messages=CHAT, max_completion_tokens=3, max_tokens=9, temperature=0.5)
    assert (fake.request.sampling.max_tokens, fake.request.sampling.temperature) == (3, 0.5)


async def test_chat_stream_opens_with_the_role_and_closes_with_usage(serve, clients, tokenizer):
    fake = FakeGenerator()
    stream = await clients(await serve(fake)).chat.completions.create(
        model="tiny", messages=CHAT, stream=True, stream_options={"include_usage": True},
        extra_body={"return_token_ids": True})
    chunks = [chunk async for chunk in stream]
    assert list(fake.request.token_ids.ids) == tokenizer.encode(CHAT_TEXT, add_special_tokens=False)
    assert {(c.id, c.object) for c in chunks} == {(f"chatcmpl-{fake.request.request_id}", "chat.completion.chunk")}
    assert (chunks[0].choices[0].delta.role, chunks[0].choices[0].delta.content) == ("assistant", "")
    assert chunks[0].prompt_token_ids == tokenizer.encode(CHAT_TEXT, add_special_tokens=False)
    assert [c.choices[0].delta.content for c in chunks[1:3]] == ["Hello", " world"]
    assert [c.choices[0].finish_reason for c in chunks[:3]] == [None, None, "length"]
    assert [c.choices[0].token_ids for c in chunks[1:3]] == [[5, 6], [7]]
    assert [c.usage for c in chunks[:3]] == [None, None, None]
    assert (chunks[3].choices, chunks[3].usage.completion_tokens) == ([], 3)
    assert len(chunks) == 4


# ---- models, auth, health ----

async def test_models_lists_the_served_model(serve, clients):
    models = await clients(await serve(FakeGenerator())).models.list()
    assert [(m.id, m.object, m.owned_by, m.max_model_len) for m in models.data] == [
        ("tiny", "model", "pdmesh", MAX_MODEL_LEN)]
    assert isinstance(models.data[0].created, int)


async def test_an_unknown_key_is_401(serve, clients):
    fake = FakeGenerator()
    address = await serve(fake, {"sk-a": "tenant-a"})
    with pytest.raises(openai.AuthenticationError) as caught:
        await clients(address, "sk-wrong").completions.create(model="tiny", prompt="Hi")
    assert caught.value.body == {"message": "unknown API key", "type": "Unauthenticated", "code": 401}
    assert fake.calls == []


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/models"])
async def test_a_missing_key_is_401_with_a_bearer_challenge(serve, path):
    fake = FakeGenerator()
    address = await serve(fake, {"sk-a": "tenant-a"})
    async with aiohttp.ClientSession() as session:
        method = session.get if path == "/v1/models" else session.post
        async with method(f"http://{address}{path}", json={"prompt": "Hi", "messages": CHAT}) as response:
            status, challenge, body = response.status, response.headers["WWW-Authenticate"], await response.json()
    assert (status, challenge) == (401, "Bearer")
    assert body == {"error": {"message": "missing API key: send 'authorization: Bearer <key>'",
                              "type": "Unauthenticated", "code": 401}}
    assert fake.calls == []


async def test_the_keys_tenant_reaches_the_generator(serve, clients):
    fake = FakeGenerator()
    await clients(await serve(fake, {"sk-a": "tenant-a"}), "sk-a").chat.completions.create(model="tiny", messages=CHAT)
    assert fake.calls[0][1] == "tenant-a"


async def test_health_needs_no_key(serve):
    address = await serve(FakeGenerator(), {"sk-a": "tenant-a"})
    async with aiohttp.ClientSession() as session, session.get(f"http://{address}/health") as response:
        assert response.status == 200


# ---- errors ----

@pytest.mark.parametrize("stream", [False, True])
async def test_overloaded_is_429(serve, clients, stream):
    client = clients(await serve(FakeGenerator(error=Overloaded("at the admission limit"))))
    with pytest.raises(openai.RateLimitError) as caught:
        await client.completions.create(model="tiny", prompt="Hi", stream=stream)
    assert caught.value.body == {"message": "at the admission limit", "type": "Overloaded", "code": 429}


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_a_full_gateway_answers_429_before_it_reads_the_body(serve, path):
    """Admission is checked before the body is read and parsed: a body that is not even JSON gets the 429
    (before, it was parsed first: 400)."""
    fake = FakeGenerator(max_in_flight=0)
    status, _, text = await _post(await serve(fake), path, "{not json")
    assert (status, json.loads(text)) == (429, {"error": {
        "message": "0 requests in flight (limit 0); retry later", "type": "Overloaded", "code": 429}})
    assert fake.calls == []


@pytest.mark.parametrize("path, body, message", [
    ("/v1/completions", {"prompt": "Hi", "n": 2}, "n=2 is not supported: only n=1"),
    ("/v1/completions", {"prompt": "Hi", "logprobs": 1}, "logprobs is not supported"),
    ("/v1/completions", {"prompt": "Hi", "echo": True}, "echo is not supported"),
    ("/v1/completions", {"prompt": "Hi", "best_of": 2}, "best_of=2 is not supported: only 1"),
    ("/v1/completions", {"prompt": ["a", "b"]}, "batched prompts are not supported: send 1 prompt per request, got 2"),
    ("/v1/completions", {"prompt": []}, "prompt is empty"),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": True}, "logprobs is not supported"),
    ("/v1/chat/completions", {"messages": CHAT, "tools": [{"type": "function"}]}, "tools are not supported"),
    ("/v1/chat/completions", {"messages": CHAT, "n": 3}, "n=3 is not supported: only n=1"),
    ("/v1/completions", "{not json", "the request body is not valid JSON"),
    ("/v1/completions", "[1, 2]", "the request body must be a JSON object"),
    ("/v1/completions", "[" * 5000 + "]" * 5000, "the request body is nested too deeply"),
    ("/v1/completions", '{"prompt": "Hi", "temperature": Infinity}',
     "invalid request: temperature: Input should be a finite number"),
    ("/v1/completions", '{"prompt": "Hi", "temperature": 2.5}',
     "invalid request: temperature: Input should be less than or equal to 2"),
    ("/v1/completions", '{"prompt": "Hi", "temperature": NaN}',
     "invalid request: temperature: Input should be a finite number"),
    ("/v1/completions", {"prompt": "Hi", "slo": {"ttft_s": -1}},
     "invalid request: slo.ttft_s: Input should be greater than or equal to 0"),
    ("/v1/completions", {"prompt": "Hi", "slo": {"tpot": 0.02}},
     "invalid request: slo.tpot: Extra inputs are not permitted"),
])
async def test_unsupported_or_malformed_requests_are_400(serve, path, body, message):
    fake = FakeGenerator()
    status, _, text = await _post(await serve(fake), path, body)
    assert (status, json.loads(text)) == (400, {"error": {"message": message, "type": "InvalidRequest", "code": 400}})
    assert fake.calls == []


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "x" * LONG_PROMPT_CHARS, "return_token_ids": True}),  # ids it would report
    ("/v1/completions", {"prompt": "x" * LONG_PROMPT_CHARS, "max_tokens": None}),        # the room left for max_tokens
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * LONG_PROMPT_CHARS}]}),
])
async def test_a_prompt_longer_than_any_context_is_refused_before_it_is_tokenized(serve, tokenizer, monkeypatch,
                                                                                 path, body):
    encoded = []
    monkeypatch.setattr(tokenizer, "encode", lambda *args, **kwargs: encoded.append(args) or [0])
    fake = FakeGenerator()
    status, _, text = await _post(await serve(fake), path, body)
    assert (status, json.loads(text)["error"]["type"]) == (400, "InvalidRequest")
    assert f"longer than the model's context of {MAX_MODEL_LEN} tokens can hold" in json.loads(text)["error"]["message"]
    assert (encoded, fake.calls) == ([], [])


async def test_a_body_over_the_limit_is_413_and_an_unknown_route_404_both_as_openai_errors(serve):
    fake = FakeGenerator()
    address = await serve(fake)
    status, _, text = await _post(address, "/v1/completions", b"{" + b" " * LIMITS.max_body_bytes + b"}")
    assert (status, json.loads(text)["error"]["type"], json.loads(text)["error"]["code"]) == (
        413, "HTTPRequestEntityTooLarge", 413)
    assert json.loads(text)["error"]["message"] == f"Maximum request body size {LIMITS.max_body_bytes} exceeded."
    status, _, text = await _post(address, "/v1/embeddings", {"input": "Hi"})
    assert (status, json.loads(text)) == (404, {"error": {"message": "404: Not Found", "type": "HTTPNotFound",
                                                          "code": 404}})
    assert fake.calls == []


async def test_field_errors_name_the_fields(serve):
    body = {"prompt": "Hi", "max_tokens": 0, "temperature": -1}
    status, _, text = await _post(await serve(FakeGenerator()), "/v1/completions", body)
    assert status == 400
    assert json.loads(text)["error"]["message"] == (
        "invalid request: temperature: Input should be greater than or equal to 0; "
        "max_tokens: Input should be greater than or equal to 1")


async def test_an_unexpected_error_is_500_and_the_server_keeps_serving(serve, clients):
    address = await serve(FakeGenerator(error=RuntimeError("boom")))
    status, _, text = await _post(address, "/v1/completions", {"prompt": "Hi"})
    assert (status, json.loads(text)) == (
        500, {"error": {"message": "internal server error", "type": "InternalServerError", "code": 500}})
    models = await clients(address).models.list()
    assert [m.id for m in models.data] == ["tiny"]


async def test_an_error_mid_stream_is_a_last_error_event_without_done(serve):
    fake = FakeGenerator(error=WorkerFailed("decode worker died"), fail_after=1)
    status, _, text = await _post(await serve(fake), "/v1/completions", {"prompt": "Hi", "stream": True})
    events = _events(text)
    assert status == 200 and len(events) == 2
    assert json.loads(events[0])["choices"][0]["text"] == "Hello"
    assert json.loads(events[1]) == {"error": {"message": "decode worker died", "type": "WorkerFailed", "code": 503}}


async def test_a_client_that_disconnects_mid_stream_closes_the_generator(serve):
    slow = [generate_pb2.GenerateResponse(token_ids=[5], text="a")] * 1000
    fake = FakeGenerator(responses=slow, delay_s=0.05)
    address = await serve(fake)
    async with aiohttp.ClientSession() as session:
        async with session.post(f"http://{address}/v1/completions", json={"prompt": "Hi", "stream": True}) as response:
            assert (await response.content.readline()).startswith(b"data: ")
    await asyncio.wait_for(fake.stopped.wait(), timeout=2.0)
    assert fake.stopped_by in ("CancelledError", "GeneratorExit")   # cancelled inside it, or closed at a yield

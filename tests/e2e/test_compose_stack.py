"""deploy/docker-compose.yml brought up for real under Podman: the images built here from the package
registries alone (scripts/build_images.sh), then Redis, the OTLP collector, Prometheus, the gateway and
two workers, in each layout: taking both roles, the gateway placing each request (the default), and
the static split (docker-compose.split.yml: worker-0 prefill, worker-1 decode). Requests go to the
published ports with the `openai` client and over gRPC and must equal monolithic vLLM, on the workers
the layout says; the collector must have the request's spans from every service that served it,
Prometheus must scrape every pdmesh process; `down` must leave nothing running.

Grafana is not started: no registry reachable here ships it (deploy/README.md)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

import openai
import pytest

from pdmesh.client import generate, make_request
from pdmesh.healthcheck import serving
from tests.e2e.conftest import MAX_TOKENS, USER_TEXT_PROMPTS, token_prompts
from tests.e2e.greedy import assert_greedy_tokens_equal
from worker.engine import free_port

pytestmark = pytest.mark.containers
ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
# layout -> its compose files: the default, or the static split over it
COMPOSE_FILES = {"both": [DEPLOY / "docker-compose.yml"],
                 "split": [DEPLOY / "docker-compose.yml", DEPLOY / "docker-compose.split.yml"]}
WORKERS = ["worker-0", "worker-1"]
WORKER_ADDRESSES = {f"{worker}:50061" for worker in WORKERS}   # as they advertise themselves
SERVICES = ["redis", "otel-collector", "prometheus", *WORKERS, "gateway"]
LOCAL_IMAGES = {"PDMESH_REDIS_IMAGE": "pdmesh-redis:bookworm",
                "PDMESH_OTEL_COLLECTOR_IMAGE": "pdmesh-otel-collector:bookworm",
                "PDMESH_PROMETHEUS_IMAGE": "pdmesh-prometheus:bookworm"}
START_TIMEOUT_S = 300


class Stack:
    def __init__(self, project: str, env: dict[str, str], layout: str) -> None:
        self.project = project
        self.env = env
        self.layout = layout
        self.grpc_address = f"127.0.0.1:{env['PDMESH_GRPC_PORT']}"
        self.http_url = f"http://127.0.0.1:{env['PDMESH_HTTP_PORT']}"
        self.prometheus_url = f"http://127.0.0.1:{env['PDMESH_PROMETHEUS_PORT']}"

    def compose(self, *args: str, timeout_s: float = 300) -> subprocess.CompletedProcess:
        files = [arg for path in COMPOSE_FILES[self.layout] for arg in ("-f", str(path))]
        return subprocess.run(["podman-compose", "-p", self.project, *files, *args], env=self.env,
                              capture_output=True, text=True, timeout=timeout_s)

    def podman(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["podman", *args], env=self.env, capture_output=True, text=True, timeout=120)

    def container(self, service: str) -> str:
        return f"{self.project}_{service}_1"

    def logs(self, service: str) -> str:
        out = self.podman("logs", self.container(service))
        return out.stdout + out.stderr

    def containers_left(self) -> list[str]:
        out = self.podman("ps", "-a", "--filter", f"label=io.podman.compose.project={self.project}",
                          "--format", "{{.Names}}")
        return out.stdout.split()


@pytest.fixture(scope="module")
def images():
    assert shutil.which("podman") and shutil.which("podman-compose"), "bash scripts/setup.sh installs podman"
    started = time.monotonic()
    built = subprocess.run(["bash", str(ROOT / "scripts" / "build_images.sh"), "podman"], capture_output=True,
                           text=True, timeout=1800)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    print(f"images built in {time.monotonic() - started:.0f} s")


@pytest.fixture(scope="module", params=list(COMPOSE_FILES))
def stack(request, images):
    """The stack in one layout (pytest runs every test on one before it brings up the other)."""
    started = time.monotonic()
    env = {**os.environ, **LOCAL_IMAGES, "CONTAINERS_CONF": str(DEPLOY / ".build" / "containers.conf"),
           **{name: str(free_port("127.0.0.1")) for name in
              ("PDMESH_GRPC_PORT", "PDMESH_HTTP_PORT", "PDMESH_PROMETHEUS_PORT")}}
    running = Stack(f"pdmesh-e2e-{os.getpid()}-{request.param}", env, request.param)
    try:
        _make_secrets(running)
        up = running.compose("up", "-d", *SERVICES)
        assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
        _wait_healthy(running, WORKERS)
        _wait_serving(running.grpc_address)  # the gateway has no compose health check: its published port
        print(f"{request.param} stack serving {time.monotonic() - started:.0f} s after it began")
        yield running
    finally:
        down = running.compose("down", "-v", timeout_s=180)
        running.podman("network", "rm", "-f", f"{running.project}_default")
    assert down.returncode == 0, down.stderr[-3000:]
    assert running.containers_left() == []


def _make_secrets(stack: Stack) -> None:
    """The stack's secrets-init service, run to its end first: podman-compose starts services in order
    but does not wait for a dependency to complete (compose's service_completed_successfully)."""
    started = stack.compose("up", "-d", "secrets-init")
    assert started.returncode == 0, started.stdout[-3000:] + started.stderr[-3000:]
    waited = stack.podman("wait", stack.container("secrets-init"))
    assert waited.stdout.strip() == "0", stack.logs("secrets-init")[-3000:]


def _wait_healthy(stack: Stack, services: list[str]) -> None:
    """Each worker's compose health check (the gRPC health service on its port) passes."""
    deadline = time.monotonic() + START_TIMEOUT_S
    for service in services:
        while stack.podman("healthcheck", "run", stack.container(service)).returncode != 0:
            assert time.monotonic() < deadline, f"{service} not healthy:\n{stack.logs(service)[-5000:]}"
            time.sleep(2)


def _wait_serving(address: str) -> None:
    host, port = address.rsplit(":", 1)
    deadline = time.monotonic() + START_TIMEOUT_S
    while not serving(host, int(port)):  # what the workers' compose health check runs
        assert time.monotonic() < deadline, f"nothing serving on {address}"
        time.sleep(1)


def test_the_openai_client_and_grpc_on_the_published_ports_answer_like_monolithic_vllm(stack, reference):
    client = openai.OpenAI(base_url=f"{stack.http_url}/v1", api_key="unused")
    want = reference["runs"][5]
    for prompt, want_ids in zip(USER_TEXT_PROMPTS, want["token_ids"]):
        completion = client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=MAX_TOKENS,
                                               temperature=0.0, extra_body={"return_token_ids": True})
        assert completion.choices[0].to_dict()["token_ids"] == want_ids

    async def all_prompts():
        return await asyncio.gather(*(generate(stack.grpc_address, make_request(p, max_tokens=MAX_TOKENS))
                                      for p in token_prompts()))

    results = asyncio.run(all_prompts())
    for index, (token_ids, _, _) in enumerate(results):
        assert_greedy_tokens_equal(token_ids, reference["runs"][0], index)
    transfers = [last.transfer for _, _, last in results]
    if stack.layout == "split":   # every prompt computed on worker-0, its KV read by worker-1
        assert {(t.prefill_worker, t.decode_worker, t.local_prefill) for t in transfers} == {
            ("worker-0:50061", "worker-1:50061", False)}
        assert sum(t.num_blocks for t in transfers) > 0  # KV crossed between the containers
        return
    for t in transfers:   # served whole on one worker, or computed on one and decoded on the other from its KV
        if t.local_prefill:
            assert (t.prefill_worker, t.decode_worker in WORKER_ADDRESSES, t.num_blocks) == ("", True, 0)
        else:
            assert {t.prefill_worker, t.decode_worker} == WORKER_ADDRESSES
    # sent together, each request is placed where the fewest streams run: both workers serve
    assert {t.decode_worker for t in transfers} == WORKER_ADDRESSES


def _traced_services(layout: str, transfer) -> set[str]:
    """The services (pdmesh-<role>, its engine's pdmesh-<role>-engine) a request's spans come from. An
    engine's spans are its KV moves (KV transfer, KV store save and load): a request served whole, on a
    prompt no KV store holds, has none."""
    if layout == "split":
        return {"pdmesh-gateway", "pdmesh-prefill", "pdmesh-prefill-engine", "pdmesh-decode", "pdmesh-decode-engine"}
    return {"pdmesh-gateway", "pdmesh-both"} | (set() if transfer.local_prefill else {"pdmesh-both-engine"})


def test_the_collector_received_the_requests_spans_from_every_service_that_served_it(stack):
    request_id = f"compose-traced-{stack.layout}"
    prompt = token_prompts(seed=7)[-1]   # computed nowhere before: no KV store holds it
    _, _, last = asyncio.run(generate(stack.grpc_address, make_request(prompt, max_tokens=4, request_id=request_id)))
    want = _traced_services(stack.layout, last.transfer)
    deadline = time.monotonic() + 30
    while True:  # the processes export in batches (2 s)
        spans = _logged_spans(stack.logs("otel-collector"))
        traces = {s["trace_id"] for s in spans if s["attributes"].get("pdmesh.client_request_id") == request_id}
        services = {s["service"] for s in spans if s["trace_id"] in traces}
        if services >= want or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert len(traces) == 1
    assert services == want


def _logged_spans(log: str) -> list[dict]:
    """Spans from the collector's detailed debug log: service, trace id, name, attributes."""
    spans, service, span = [], None, None
    for line in log.splitlines():
        if m := re.match(r"\s+-> service\.name: Str\((.*)\)$", line):
            service = m.group(1)
        elif re.match(r"Span #\d+", line):
            span = {"service": service, "attributes": {}}
            spans.append(span)
        elif span is not None and (m := re.match(r"\s+Trace ID\s+: (\w+)", line)):
            span["trace_id"] = m.group(1)
        elif span is not None and (m := re.match(r"\s+-> ([\w.]+): \w+\((.*)\)$", line)):
            span["attributes"][m.group(1)] = m.group(2)
        elif line.startswith("ResourceSpans"):
            span = None
    return [s for s in spans if "trace_id" in s]


def test_prometheus_scrapes_every_pdmesh_process(stack):
    deadline = time.monotonic() + 30
    while True:
        with urllib.request.urlopen(f"{stack.prometheus_url}/api/v1/targets", timeout=10) as response:
            targets = json.loads(response.read())["data"]["activeTargets"]
        health = {t["labels"]["instance"]: t["health"] for t in targets}
        if set(health.values()) == {"up"} or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert health == {"gateway:9400": "up", "worker-0:9400": "up", "worker-1:9400": "up"}

"""A real local cluster (gateway + prefill + decode processes running vLLM) and the monolithic
vLLM reference outputs for the same prompts, computed before the cluster starts."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import time
from pathlib import Path

import grpc
import pytest

from gateway.server import Gateway
from pdmesh.cluster import LocalCluster
from pdmesh.config import GatewaySettings, TlsSettings
from pdmesh.tls import open_channel
from pdmesh.transport.mesh_auth import with_mesh_token
from pdmesh.v1 import worker_pb2, worker_pb2_grpc
from tests.conftest import MESH_TOKEN
from tests.e2e.fuzz_tally import TALLY, TALLY_PATH_ENV
from tests.otlp_receiver import OtlpReceiver
from tests.redis_server import RedisServer
from worker.baseline import run_in_subprocess

pytestmark = pytest.mark.vllm

BLOCK_SIZE = 32
MAX_TOKENS = 24
# 1 token, around one block, many blocks with and without a remainder.
PROMPT_LENGTHS = [1, 2, 17, 31, 32, 33, 63, 64, 65, 100, 128, 129, 250, 500, 777, 1000, 1500]
TEXT_PROMPTS = ["Hello world, the kalo mine is ready.", "A", "Quexst tamira lodebe is the fa of hello.",
                " leading space and trailing space "]
SEEDED = {"max_tokens": 16, "temperature": 0.8, "top_p": 0.9, "seed": 1234}
HOLD_TIMEOUT_S = 8.0  # prefill frees KV no decode released after this long
ABANDONED_TRANSFERS: list[str] = []  # request ids whose KV a test leaves to expire on purpose
LOST_KV_PROMPT = [0] + [(i * 37 + 11) % 1000 + 3 for i in range(99)]


STORE_PREFIX_TOKENS = 512   # 16 full blocks shared by the two prompts of a KV-store scenario
STORE_SUFFIX_TOKENS = 40
STORE_SCENARIOS = ["device", "dram", "nvme", "remote", "redis_flushed", "redis_restarted", "corrupt_nvme"]


def store_prompt_pair(scenario: str) -> tuple[list[int], list[int]]:
    """Two prompts sharing a long prefix no other scenario uses."""
    rng = random.Random(f"store-{scenario}")
    prefix = [0] + [rng.randrange(3, 1024) for _ in range(STORE_PREFIX_TOKENS - 1)]
    return tuple(prefix + [rng.randrange(3, 1024) for _ in range(STORE_SUFFIX_TOKENS)] for _ in range(2))


# The transport tests' wrong-KV control (test_mesh_transports.py): per transport, a prompt whose KV is
# altered unchecked, and one whose altered KV the checksum catches. Sent by no other test: decode's
# prefix cache keeps what landed.
KV_TRANSPORTS = ["shm", "mooncake", "grpc"]
LAYERWISE_SEED = 2027  # the layer-wise flow's equivalence prompts (token_prompts(LAYERWISE_SEED))
TAMPER_PROMPT_TOKENS = 300


def tamper_prompts(transport: str) -> tuple[list[int], list[int]]:
    rng = random.Random(f"tamper-{transport}")
    return tuple([0] + [rng.randrange(3, 1024) for _ in range(TAMPER_PROMPT_TOKENS - 1)] for _ in range(2))


def kill_prompts(transport: str) -> tuple[list[int], list[int]]:
    """A decode, then the prefill, is killed in the middle of these prompts' KV reads (16 blocks: two
    gRPC messages)."""
    rng = random.Random(f"kill-{transport}")
    return tuple([0] + [rng.randrange(3, 1024) for _ in range(499)] for _ in range(2))


def token_prompts(seed: int = 2026) -> list[list[int]]:
    """A prompt of each of PROMPT_LENGTHS (another seed: other prompts, for a test whose prefix caches
    must not hold them already)."""
    rng = random.Random(seed)
    return [[0] + [rng.randrange(3, 1024) for _ in range(n - 1)] for n in PROMPT_LENGTHS]


GREEDY = {"max_tokens": MAX_TOKENS, "temperature": 0.0}

# The gateway-for-users tests (test_gateway_users.py): OpenAI API prompts, a chat, and a long greedy
# generation that a decode worker is killed in the middle of.
USER_TEXT_PROMPTS = ["Hello world, the kalo mine is ready.", "Quexst tamira lodebe is the fa of hello."]
USER_CHATS = [[{"role": "system", "content": "You answer briefly."},
               {"role": "user", "content": "Hello world, is the kalo mine ready?"}]]
FAILOVER_PROMPT = [0] + [(i * 53 + 7) % 1000 + 3 for i in range(99)]
# Long enough that the kill lands mid-stream: the test first waits for the prompt's KV to be saved.
FAILOVER_SAMPLING = {"max_tokens": 500, "temperature": 0.0, "ignore_eos": True}


def pytest_sessionfinish(session) -> None:
    """The fuzz tests' answers, for bench/fuzz.py's report, when it asked for them."""
    if TALLY_PATH_ENV in os.environ:
        TALLY.write(Path(os.environ[TALLY_PATH_ENV]))


@pytest.fixture(scope="session")
def reference(tiny_llama_dir, tmp_path_factory) -> dict:
    """Monolithic vLLM outputs: runs[0] greedy on token prompts (with near_ties), [1] greedy on text, [2] seeded,
    [3] greedy on LOST_KV_PROMPT, [4] greedy on the KV-store scenarios' prompt pairs (flattened),
    [5] greedy on USER_TEXT_PROMPTS, [6] greedy on USER_CHATS (vLLM's chat), [7] FAILOVER_PROMPT,
    [8] greedy on each transport's tamper_prompts (flattened, in KV_TRANSPORTS order), [9] the same
    for kill_prompts, [10] greedy on LAYERWISE_PROMPTS, [11] as [8] for the layer-wise flow's
    tamper_prompts(f"layerwise-{transport}"), [12] greedy on kill_prompts("layerwise")."""
    return run_in_subprocess(tiny_llama_dir, [
        {"prompts": token_prompts(), "sampling": {**GREEDY, "logprobs": 2}},
        {"prompts": TEXT_PROMPTS, "sampling": GREEDY},
        {"prompts": token_prompts()[:4], "sampling": SEEDED},
        {"prompts": [LOST_KV_PROMPT], "sampling": GREEDY},
        {"prompts": [p for scenario in STORE_SCENARIOS for p in store_prompt_pair(scenario)], "sampling": GREEDY},
        {"prompts": USER_TEXT_PROMPTS, "sampling": GREEDY},
        {"chats": USER_CHATS, "sampling": GREEDY},
        {"prompts": [FAILOVER_PROMPT], "sampling": FAILOVER_SAMPLING},
        {"prompts": [p for transport in KV_TRANSPORTS for p in tamper_prompts(transport)], "sampling": GREEDY},
        {"prompts": [p for transport in KV_TRANSPORTS for p in kill_prompts(transport)], "sampling": GREEDY},
        {"prompts": token_prompts(LAYERWISE_SEED), "sampling": GREEDY},
        {"prompts": [p for transport in KV_TRANSPORTS for p in tamper_prompts(f"layerwise-{transport}")],
         "sampling": GREEDY},
        {"prompts": list(kill_prompts("layerwise")), "sampling": GREEDY},
    ], tmp_path_factory.mktemp("reference"))


@pytest.fixture(scope="module")
def redis(tmp_path_factory):
    """A real Redis (password set) for one test module: the KV store's index, the worker registry."""
    server = RedisServer(tmp_path_factory.mktemp("redis"), password="mesh-pw").start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def otlp_receiver():
    receiver = OtlpReceiver()
    yield receiver
    receiver.stop()


def telemetry_flags(otlp_endpoint: str) -> list[str]:
    """Every process exports spans to the test's receiver and serves /metrics on a free port."""
    return ["--telemetry.exporter", "otlp", "--telemetry.otlp_endpoint", otlp_endpoint,
            "--telemetry.export_delay_ms", "100", "--telemetry.metrics_port", "0", "--telemetry.log_format", "json"]


@pytest.fixture(scope="session")
def cluster(tiny_llama_dir, reference, otlp_receiver, tmp_path_factory):
    with LocalCluster(tiny_llama_dir, tmp_path_factory.mktemp("cluster"),
                      worker_args=["--hold_timeout_s", str(HOLD_TIMEOUT_S)],
                      telemetry_args=telemetry_flags(otlp_receiver.endpoint)) as running:
        yield running
        assert_nothing_pinned(running, num_expired=len(ABANDONED_TRANSFERS))


def assert_nothing_pinned(cluster: LocalCluster, num_expired: int = 0) -> None:
    """Leak check: every transfer the prefill workers pinned was released (or expired, if expected)."""
    for address in cluster.prefill_addresses:
        stats = asyncio.run(settled_stats(address))
        assert (stats.num_held_transfers, stats.num_expired_transfers) == (0, num_expired), address


def mesh_channel(address: str, tls: TlsSettings | None = None) -> grpc.aio.Channel:
    """A channel to a worker of the session's clusters: its calls carry their mesh token."""
    return open_channel(address, tls or TlsSettings(), mesh_token=MESH_TOKEN)


def sync_mesh_channel(address: str) -> grpc.Channel:
    return with_mesh_token(grpc.insecure_channel(address), MESH_TOKEN)


async def worker_stats(address: str, tls: TlsSettings | None = None) -> worker_pb2.WorkerStats:
    async with mesh_channel(address, tls) as channel:
        return await worker_pb2_grpc.WorkerInfoStub(channel).GetStats(worker_pb2.GetStatsRequest())


async def settled_stats(address: str, tls: TlsSettings | None = None) -> worker_pb2.WorkerStats:
    """A worker's stats once the last request's tail work is done: a prefill still saving to its store, or a
    release still on the wire, keeps a transfer pinned for a moment after the client has its tokens. A transfer
    nobody releases ends by expiring after HOLD_TIMEOUT_S, which the caller's num_expired_transfers check sees."""
    deadline = time.monotonic() + HOLD_TIMEOUT_S + 5
    while True:
        stats = await worker_stats(address, tls)
        busy = (stats.num_held_transfers, stats.num_running_requests, stats.kv_store_pinned_blocks,
                stats.kv_store_saves_pending) != (0, 0, 0, 0)
        if not busy or time.monotonic() > deadline:
            return stats
        await asyncio.sleep(0.1)


@contextlib.asynccontextmanager
async def in_process_gateway(cluster: LocalCluster, tokenizer_dir: Path, prefill_workers: list[str] | None = None,
                             with_gateway: bool = False, **settings):
    """A second gateway (here, in the test's process) in front of the cluster's workers."""
    settings.setdefault("decode_workers", cluster.decode_addresses)
    settings.setdefault("mesh_token", cluster.mesh_token)
    gateway = Gateway(GatewaySettings(port=0, prefill_workers=prefill_workers or cluster.prefill_addresses,
                                      tokenizer=str(tokenizer_dir), **settings))
    address = await gateway.start()
    try:
        yield (gateway, address) if with_gateway else address
    finally:
        await gateway.stop(0)

"""One settings object per process: defaults < config file (TOML/JSON) < env (PDMESH_*) < CLI flags."""

from __future__ import annotations

import json
import sys
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator
from pydantic_settings import BaseSettings, CliSettingsSource, PydanticBaseSettingsSource, SettingsConfigDict

from pdmesh.fault_settings import KVFaultSettings

DEFAULT_MODEL_DIR = Path.home() / ".cache" / "pdmesh" / "models" / "tiny-llama"


class EngineSettings(BaseModel):
    """How a worker runs its vLLM engine."""

    model: str = str(DEFAULT_MODEL_DIR)
    served_model_name: str = "tiny-llama"
    dtype: str = "float32"
    block_size: int = 32               # CPU attention needs a multiple of 32
    max_model_len: int = 4096
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None  # tokens per engine step (a longer prompt is chunked); None: vLLM's
    kv_cache_space_gib: int = 1        # VLLM_CPU_KVCACHE_SPACE
    omp_threads_bind: str = "auto"     # VLLM_CPU_OMP_THREADS_BIND ("0-1", "nobind", one range per rank: "0|1")
    tensor_parallel_size: int = 1      # ranks; each serves its share of the KV heads on kv_port + rank
    enforce_eager: bool = True
    enable_prefix_caching: bool = True
    seed: int = 0
    # vLLM's attention backend by name; None: vLLM's choice. On CPUs with AMX vLLM picks AMX_MLA for MLA
    # models, which needs bf16 weights: CPU_MLA runs them in float32.
    attention_backend: str | None = None
    # oneDNN's process-wide primitive cache (ONEDNN_PRIMITIVE_CACHE_CAPACITY; oneDNN's default: 1024
    # primitives). vLLM's CPU GEMMs keep their own cache of 32 shapes per layer, so the global one only
    # adds memory: a primitive per new batch shape, ~265 MiB of a prefill engine's heap within 90 s of
    # varied prompt lengths, at no speed gain here (bench/REPORT.md, Soak).
    onednn_primitive_cache_capacity: int = 0


class TelemetrySettings(BaseModel):
    """Traces, metrics and logs of one process."""

    exporter: Literal["none", "console", "otlp"] = "none"
    otlp_endpoint: str = "127.0.0.1:4317"   # an OpenTelemetry collector's OTLP/gRPC port
    export_delay_ms: int = 2000             # batch span processor's schedule delay
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = None         # Prometheus /metrics; 0 picks a free port; None: off
    log_format: Literal["text", "json"] = "text"


class StoreSettings(BaseModel):
    """A prefill worker's tiered KV store (device → DRAM → NVMe) and the shared Redis index.
    A tier with 0 bytes is left out; NVMe also needs a directory of its own per worker."""

    enabled: bool = True
    device_bytes: int = 64 << 20          # accelerator buffer pool (host memory on the CPU target)
    dram_bytes: int = 256 << 20           # host slab (pinned where the device supports it)
    nvme_bytes: int = 1 << 30
    nvme_dir: Path | None = None          # one file per block; blocks survive a restart
    nvme_fsync: bool = True               # crash-safe writes (tests of eviction order may turn it off)
    redis_url: str | None = None          # e.g. redis://127.0.0.1:6379/0; None: no cross-worker reuse
    redis_password: str | None = None
    index_ttl_s: int = 3600               # index entries of a node that stops refreshing them expire
    lookup_timeout_s: float = 1.0         # the scheduler's lookup; on timeout the prompt is computed
    fetch_timeout_s: float = 10.0         # a fetch from another node's store
    export_bytes: int = 64 << 20          # blocks handed to other nodes, held (in shared memory) until read
    save_queue_bytes: int = 256 << 20     # copies waiting to be written; a save past this is skipped (counted)
    # A load is cut (the rest computed) once it has taken load_budget_factor x the time the engine would
    # take to compute its tokens, at the rate it measures on its own steps (worker/compute_rate.py),
    # or load_budget_min_s if longer (a first connection to a peer is not a slow tier).
    load_budget_factor: float = 1.0
    load_budget_min_s: float = 0.05


class SloSettings(BaseModel):
    """A tenant's latency targets (None: the gateway's)."""

    ttft_s: float | None = Field(None, gt=0)
    tpot_s: float | None = Field(None, ge=0)


class TlsSettings(BaseModel):
    """Mutual TLS on the gateway-worker links: PEM files. A worker with cert+key serves TLS and, given
    ca_file, requires client certificates signed by it; the gateway dials with its own cert+key and
    trusts servers signed by ca_file. Unset (the default): plaintext."""

    cert_file: Path | None = None
    key_file: Path | None = None
    ca_file: Path | None = None

    @property
    def enabled(self) -> bool:
        return self.cert_file is not None or self.ca_file is not None


class RegistrySettings(BaseModel):
    """The worker registry in Redis: workers heartbeat a record with a TTL; gateways watch it."""

    redis_url: str | None = None          # None: no registry (the gateway uses its static lists)
    redis_password: str | None = None
    heartbeat_s: float = 1.0              # a worker refreshes its record this often
    ttl_s: float = 3.0                    # a record not refreshed for this long is gone
    poll_s: float = 0.5                   # the gateway re-reads the registry this often
    prefix: str = "pdmesh:workers"


class _LayeredSettings(BaseSettings):
    """Adds a config file (path in `config_file`, from env or CLI) below env and CLI."""

    config_file: Path | None = None

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings, dotenv_settings,
                                   file_secret_settings) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings, env_settings, _FileSource(settings_cls, init_settings, env_settings))

    @classmethod
    def from_cli(cls, argv: list[str] | None = None, **overrides: Any):
        """Parses argv (flags like --port 50051 --engine.model /path) on top of file and env."""
        args = sys.argv[1:] if argv is None else argv
        config_file = _flag_value(args, "--config_file")
        if config_file is not None:
            overrides.setdefault("config_file", config_file)
        cli = CliSettingsSource(cls, cli_prog_name="pdmesh", cli_implicit_flags=True)
        return cls(_cli_settings_source=cli(args=args), **overrides)


def _flag_value(args: list[str], flag: str) -> str | None:
    """The value of `flag` in args (`--flag v` or `--flag=v`), so the file source sees it too."""
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


class _FileSource(PydanticBaseSettingsSource):
    def __init__(self, settings_cls, init_settings, env_settings) -> None:
        super().__init__(settings_cls)
        self._path = init_settings().get("config_file") or env_settings().get("config_file")

    def get_field_value(self, field, field_name):  # pragma: no cover - whole-file source
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        if not self._path:
            return {}
        path = Path(self._path)
        text = path.read_text()
        return tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)


class KVTransportFields(BaseModel):
    """How KV moves between workers: WorkerSettings has these flat (--kv_transport, --mesh_token),
    KVTransportSettings carries them to the connector."""

    # How KV moves between prefill and decode (pdmesh/transport/kv_transport.py): "auto" agrees the best
    # both ends support per peer (shared memory on one host, Mooncake, else gRPC); a name forces that one.
    kv_transport: Literal["auto", "grpc", "shm", "mooncake"] = "auto"
    # Mooncake Transfer Engine is off unless this names the worker's address on a data network only the
    # mesh's workers reach (an RDMA fabric, a dedicated VLAN): its port serves reads and writes of the
    # registered KV memory to any peer, without credentials, and listens on every interface whatever
    # host it is given (the pinned wheel; docs/limits.md). Peers dial the engine at this host.
    mooncake_host: str | None = None
    mooncake_protocol: str = "tcp"     # "rdma" where the host has RDMA NICs; "ascend" with the NPU wheel
    mooncake_device: str = ""          # the engine's device filter (RDMA NIC or NPU names), "" for all
    # Shared secret of the mesh's internal ports (the Prefill/Decode/WorkerInfo port, KV transfer, KV store):
    # every worker and gateway of a mesh sets the same one; calls without it are refused (UNAUTHENTICATED).
    mesh_token: str | None = None
    # Mutual TLS on the KV ports: the worker's certificate serves its KV port and is its client
    # certificate when it reads from another's (so it needs both server and client use); unset: plaintext.
    kv_tls: TlsSettings = Field(default_factory=TlsSettings)
    kv_faults: KVFaultSettings = Field(default_factory=KVFaultSettings)
    # Layer-wise flow, producer: a step's newly written layers are announced to the consumer (a Watch
    # answer, a round trip on this worker's cores while it computes) once they hold this many bytes, or
    # when the step is done. Announcing a small layer costs the producer about what reading it early
    # hides. 0: every layer.
    layerwise_read_bytes: int = 4 << 20

    @model_validator(mode="after")
    def _mooncake_needs_its_network(self):
        _check_mooncake_host(self.kv_transport, self.mooncake_host)
        return self


class KVTransportSettings(KVTransportFields):
    """What the connector in the engine's worker process needs to move KV (from WorkerSettings)."""

    def allows(self, transport: str) -> bool:
        """Whether KV may move over `transport`: Mooncake only where its data network is configured."""
        if transport == "mooncake" and not self.mooncake_host:
            return False
        return self.kv_transport in ("auto", transport)

    @property
    def auth(self):
        """The mesh credentials of the KV ports (pdmesh/transport/mesh_auth.py)."""
        from pdmesh.transport.mesh_auth import MeshAuth

        return MeshAuth(self.mesh_token, self.kv_tls)


class ConnectorSettings(BaseModel):
    """What the connector in the engine's processes needs, built from WorkerSettings once
    (worker/engine.py), carried by vLLM as kv_connector_extra_config, and read back whole by the
    connector (worker/connector.py): no field is parsed or defaulted twice."""

    kv_host: str                        # where the KV port binds
    kv_port: int                        # rank 0's; rank r binds kv_port + r
    kv_advertise_address: str           # host:port peers dial for rank 0's KV (WorkerSettings.kv_address_for_peers)
    hold_timeout_s: float
    pull_timeout_s: float
    transport: KVTransportSettings
    gil_switch_interval_s: float | None  # the model worker's GIL switch interval (None: Python's)
    wake_name: str                      # the engine's quiet-steps socket ("": steps always run the workers)
    queue_spin_s: float | None          # vLLM's queue readers' spin (None: the platform's default)
    thread_cpus: str                    # where layer-wise reads run ("": every core)
    initial_prefill_tokens_per_s: float  # the engine's prompt rate until it has measured its own steps
    store: StoreSettings | None         # prefill's KV store (None: decode)
    telemetry: TelemetrySettings

    @property
    def advertised(self) -> tuple[str, int]:
        """The host and (rank 0's) port peers reach the KV port at."""
        host, port = self.kv_advertise_address.rsplit(":", 1)
        return host, int(port)


class WorkerSettings(_LayeredSettings, KVTransportFields):
    model_config = SettingsConfigDict(env_prefix="PDMESH_WORKER_", env_nested_delimiter="__")

    # "both": the worker computes prompts and holds their KV for others, decodes from a handle, or serves a
    # request whole, whichever the gateway asks of it per request (python -m node).
    role: Literal["prefill", "decode", "both"] = "prefill"
    host: str = "127.0.0.1"
    port: int = 0                      # 0: pick a free port and report it
    kv_host: str = "127.0.0.1"         # prefill: where its KV-transfer server listens
    kv_advertise_host: str | None = None  # how decode reaches it (a container's service name); default kv_host
    kv_port: int = 0                   # 0: pick a free port before the engine starts
    kv_advertise_port: int | None = None  # the port decode dials (a port mapping or proxy in front); default kv_port
    # A worker refuses to start without a mesh credential (mesh_token, or mTLS with client certificates on
    # both its ports: tls.ca_file and kv_tls.ca_file); this lets it serve anyone who reaches its ports.
    insecure_no_mesh_auth: bool = False
    hold_timeout_s: float = 60.0       # prefill frees unreleased KV after this long
    pull_timeout_s: float = 30.0
    # Python's GIL switch interval in the engine's model-worker process (None: Python's 5 ms). The KV threads
    # there (pulls, the KV server, store saves) need the GIL between their C calls, behind a model runner that
    # holds it. 0.5 ms measured mixed (bench/REPORT.md: long prompts a little better, short ones worse).
    kv_gil_switch_interval_s: float | None = None
    # Engine steps skip the model workers while every request waits for its KV and no transfer has finished
    # (the workers say when one has): vLLM would step them once a millisecond for as long as a request waits,
    # which the layer-wise flow makes as long as prefill (worker/vllm_ext/quiet_steps.py).
    kv_quiet_steps: bool = True
    # How long vLLM's queues between the engine core and its model workers busy-poll after each message
    # before they sleep on a socket (worker/vllm_ext/queue_spin.py); None: 0 on the CPU, where the spin
    # takes the cores the model computes on (engines sharing cores starved each other for seconds:
    # bench/REPORT.md, Soak), vLLM's own 1 s on accelerators.
    engine_queue_spin_s: float | None = None
    # Cores the worker's own processes (its API server, vLLM's engine core) and its layer-wise reading
    # threads run on, e.g. "1" or "2-3"; "": any.
    # A local cluster keeps a decode worker's on its engine's core: where vLLM's queues between them busy-poll
    # after each step (engine_queue_spin_s), that then does not take prefill's core (bench/REPORT.md, layer-wise).
    process_cpus: str = ""
    # The engine's prompt rate (tokens/s) until it has measured its own steps (worker/compute_rate.py): the
    # budget of its KV store loads, and what it publishes for the gateways' choice of where to prefill.
    initial_prefill_tokens_per_s: float = 5000.0
    advertise_host: str | None = None  # how gateways reach this worker (registry record); default host
    ready_file: Path | None = None     # written with {"address": ...} once serving
    exit_with_parent: bool = False     # stop when the launching process dies (local clusters, tests)
    tls: TlsSettings = Field(default_factory=TlsSettings)             # mTLS of the Prefill/Decode/WorkerInfo port
    registry: RegistrySettings = Field(default_factory=RegistrySettings)
    engine: EngineSettings = Field(default_factory=EngineSettings)
    store: StoreSettings = Field(default_factory=StoreSettings)   # prefill only
    telemetry: TelemetrySettings = Field(default_factory=TelemetrySettings)

    @property
    def produces(self) -> bool:
        """It computes prompts whose KV other workers read (its KV port, its KV store)."""
        return self.role in ("prefill", "both")

    @property
    def consumes(self) -> bool:
        """It reads other workers' KV."""
        return self.role in ("decode", "both")

    @property
    def address_for_gateways(self) -> str:
        """host (advertise_host if set) of the worker's main port; the port is filled in once bound."""
        return self.advertise_host or self.host

    @property
    def kv_transport_settings(self) -> KVTransportSettings:
        """This worker's KV transport fields (flat on the command line: --kv_transport, --mesh_token)."""
        return KVTransportSettings(**{name: getattr(self, name) for name in KVTransportFields.model_fields})

    @property
    def kv_host_for_peers(self) -> str:
        """The host decode workers dial for this worker's KV (kv_advertise_host, else kv_host)."""
        return self.kv_advertise_host or self.kv_host

    def kv_address_for_peers(self, kv_port: int) -> str:
        """host:port decode workers dial for this worker's KV, its server bound on kv_port."""
        return f"{self.kv_host_for_peers}:{self.kv_advertise_port or kv_port}"


def _check_mooncake_host(kv_transport: str, mooncake_host: str | None) -> None:
    if kv_transport == "mooncake" and not mooncake_host:
        raise ValueError("kv_transport=mooncake needs --mooncake_host: the worker's address on the isolated data "
                         "network Mooncake's engine serves (its port takes any peer's reads and writes)")


class GatewaySettings(_LayeredSettings):
    model_config = SettingsConfigDict(env_prefix="PDMESH_GATEWAY_", env_nested_delimiter="__")

    host: str = "127.0.0.1"
    port: int = 50051
    prefill_workers: list[str] = Field(default_factory=list)   # host:port
    decode_workers: list[str] = Field(default_factory=list)
    workers: list[str] = Field(default_factory=list)   # host:port of workers taking both roles (python -m node)
    tokenizer: str = str(DEFAULT_MODEL_DIR)                     # folder with tokenizer.json
    request_timeout_s: float = 300.0
    # "decode": vLLM's P/D flow, decode samples the first token again (seeded sampling matches a
    # monolithic engine). "prefill": SGLang's, prefill's token streams at once and decode starts
    # from prompt + token (earlier first token, no recompute; a new seed stream from token 2 on).
    first_token_from: Literal["decode", "prefill"] = "decode"
    # "pull": decode reads the prompt's KV once prefill is done (vLLM's P/D flow). "layerwise": decode is
    # picked and reserves its blocks before prefill starts, and reads each layer as prefill writes it
    # (the transfer hides behind prefill's compute; decode samples the first token, first_token_from aside).
    kv_flow: Literal["pull", "layerwise"] = "pull"
    # Every decode on a worker shares one DecodeStreams call, each engine step's tokens of all its streams
    # one message (gateway/decode_streams.py); False: a Decode call per request (a message per token).
    decode_streams: bool = True
    http_port: int | None = None        # OpenAI-compatible HTTP API; 0 picks a free port; None: off
    # The HTTP API's limits (gateway/http_connections.py, gateway/http_body.py). A body over http_max_body_bytes is
    # 413 (nginx allows 1 MiB, vLLM any size; a 128k-token prompt sent as ids is ~1 MB); one not all arrived within
    # http_body_timeout_s is 408 (nginx's client_body_timeout is 60 s between reads). A new connection whose first
    # request head has not arrived within http_header_timeout_s is closed (slowloris; nginx's
    # client_header_timeout is 60 s, Go servers' ReadHeaderTimeout commonly 10 s); an idle keep-alive connection
    # after http_keepalive_timeout_s (vLLM's uvicorn 5 s, nginx 75 s; longer than httpx's 5 s and aiohttp's 15 s
    # client pools keep one, so the client closes first). Past http_max_connections open connections a new one
    # is answered 503 at once and closed (nginx's worker_connections is 512).
    http_max_body_bytes: int = Field(4 * 1024 * 1024, gt=0)
    http_body_timeout_s: float = Field(60.0, gt=0)
    http_header_timeout_s: float = Field(10.0, gt=0)
    http_keepalive_timeout_s: float = Field(30.0, gt=0)
    http_max_connections: int = Field(512, gt=0)
    # Where prompts are computed (gateway/disagg.py): "remote" always on a prefill worker (P/D), "local" always
    # on the decode worker, "conditional" per request from measured costs (Dynamo's conditional disaggregation).
    # adaptive: over workers taking both roles, each request served whole or split over a pair, from
    # predicted TTFT and the stall it inflicts on running streams (gateway/placement.py)
    disagg_policy: Literal["remote", "local", "conditional", "adaptive"] = "remote"
    # adaptive: options predicted past a request's TTFT or TPOT SLO are taken last, and a stream whose mean TPOT
    # a prompt computed on its worker would take past its SLO moves to another (gateway/flows.py; 0: no TPOT
    # SLO). Per tenant: {"tenant": {"ttft_s": 1.0, "tpot_s": 0.025}}; a request may ask its own (its `slo`).
    ttft_slo_s: float = Field(2.5, gt=0)
    tpot_slo_s: float = Field(0.06, ge=0)
    tenant_slos: dict[str, SloSettings] = Field(default_factory=dict)
    max_local_stall_s: float = 0.1          # conditional: a busy decode prefills locally only if its streams wait <= this
    disagg_initial_handoff_s: float = 0.02         # conditional: prefill response -> decode's first token, until measured
    # Routing (gateway/routing.py explains the cost model): "round_robin", "least_loaded", "prefix_aware".
    route_policy: Literal["round_robin", "least_loaded", "prefix_aware"] = "prefix_aware"
    route_load_tokens: int = 256        # prefix_aware: one queued request costs as much as computing this many tokens
    kv_index_redis_url: str | None = None   # the KV store's Redis index (prefix_aware reads it)
    kv_index_redis_password: str | None = None
    registry: RegistrySettings = Field(default_factory=RegistrySettings)
    worker_tls: TlsSettings = Field(default_factory=TlsSettings)    # the gateway's client side of mTLS
    # The mesh's shared secret (the workers' --mesh_token): sent on every call to a worker, whose ports
    # refuse callers without it; also keys the signatures of what the gateway reads from Redis.
    mesh_token: str | None = None
    # Limits: a request beyond them is INVALID_ARGUMENT / 400; beyond max_in_flight, RESOURCE_EXHAUSTED / 429.
    max_prompt_tokens: int | None = None
    max_tokens_limit: int | None = None
    max_in_flight: int = 256
    # Each API key's tenant may hold at most this many of those slots (a long generation or a slow reader
    # holds one); None: no per-tenant bound. Without API keys every client is one tenant: max_in_flight only.
    max_in_flight_per_tenant: int | None = 64
    max_attempts: int = 3               # tries per request across workers (failover), first included
    worker_cooldown_s: float = 5.0      # a worker that failed a call is skipped this long
    # A request that finds no worker of a role up waits this long for one to come back (those cooling
    # down are probed) before it fails UNAVAILABLE / 503: a restart is a delay, not an outage.
    worker_wait_s: float = 10.0
    # API keys (gRPC `authorization: Bearer <key>` metadata, HTTP `Authorization: Bearer <key>`),
    # key -> tenant. Empty: no auth. Each tenant's prompts get their own cache salt, so no tenant
    # ever hits another's cached prefix.
    api_keys: dict[str, str] = Field(default_factory=dict)
    # Keys the tenants' cache salts (HMAC of the tenant's name): a salt cannot be computed from the name.
    # Unset: derived from mesh_token; neither set: random per process. Every gateway of a mesh needs the
    # same key, or a tenant's prefixes are not found across gateways or after a restart.
    salt_secret: str | None = None
    ready_file: Path | None = None
    exit_with_parent: bool = False
    telemetry: TelemetrySettings = Field(default_factory=TelemetrySettings)

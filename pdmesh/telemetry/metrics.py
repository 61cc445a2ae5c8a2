"""Prometheus metrics of one pdmesh process, on a registry of its own (several can live in one
test process). Every metric carries the process's role as a label."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
GBPS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 100.0)


class MeshMetrics:
    def __init__(self, role: str) -> None:
        self.role = role
        self.registry = CollectorRegistry()
        r = self.registry
        # Registered first: the registry collects in registration order, so these callbacks
        # refresh values pulled from elsewhere before the metrics below are read.
        self._scrape_hooks = _ScrapeHooks()
        r.register(self._scrape_hooks)
        self.requests = Counter("pdmesh_requests", "Requests finished, by gRPC status", ["role", "status"],
                                registry=r)
        self.in_flight = Gauge("pdmesh_requests_in_flight", "Requests being served now", ["role"], registry=r)
        self.ttft = Histogram("pdmesh_ttft_seconds", "Time from request arrival to its first token", ["role"],
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("pdmesh_itl_seconds", "Time between consecutive output chunks", ["role"],
                             buckets=LATENCY_BUCKETS, registry=r)
        self.prefill_tokens = Counter("pdmesh_prefill_tokens", "Prompt tokens at prefill, computed or cached",
                                      ["role", "kind"], registry=r)
        self.cache_query_tokens = Counter("pdmesh_kv_cache_query_tokens", "Prompt tokens looked up in KV caches",
                                          ["role"], registry=r)
        self.cache_hit_tokens = Counter("pdmesh_kv_cache_hit_tokens", "Prompt tokens found, by tier",
                                        ["role", "tier"], registry=r)
        self.kv_bytes = Counter("pdmesh_kv_transfer_bytes", "KV bytes moved between workers",
                                ["role", "direction", "transport"], registry=r)
        self.kv_gbps = Histogram("pdmesh_kv_transfer_gbps", "Achieved GB/s of each KV transfer",
                                 ["role", "transport"], buckets=GBPS_BUCKETS, registry=r)
        self.kv_seconds = Histogram("pdmesh_kv_transfer_seconds", "Duration of each KV transfer",
                                    ["role", "transport"], buckets=LATENCY_BUCKETS, registry=r)
        self.kv_overlap_ratio = Histogram("pdmesh_kv_overlap_ratio", "Layer-wise flow: share of each KV transfer's "
                                          "time hidden behind prefill compute", ["role", "transport"],
                                          buckets=(0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0),
                                          registry=r)
        self.kv_failed_blocks = Counter("pdmesh_kv_failed_blocks", "KV blocks that failed to load (recomputed)",
                                        ["role"], registry=r)
        self.queue_depth = Gauge("pdmesh_engine_queue_depth", "Requests waiting in the vLLM scheduler", ["role"],
                                 registry=r)
        self.running = Gauge("pdmesh_engine_running_requests", "Requests running in the vLLM scheduler", ["role"],
                             registry=r)
        self.tier_occupancy = Gauge("pdmesh_kv_tier_occupancy_bytes", "KV bytes held, by tier", ["role", "tier"],
                                    registry=r)
        self.store_corrupt_blocks = Counter("pdmesh_kv_store_corrupt_blocks",
                                            "KV store blocks that failed their checksum on read (dropped, recomputed)",
                                            ["role"], registry=r)
        self.store_blocks_saved = Counter("pdmesh_kv_store_blocks_saved", "Blocks written to the KV store", ["role"],
                                          registry=r)
        self.disagg_decisions = Counter("pdmesh_disagg_decisions", "Where requests' prompts were computed "
                                        "(remote: a prefill worker; local: the decode worker), and why",
                                        ["role", "decision", "reason"], registry=r)
        self.placed_prompt_tokens = Counter("pdmesh_placed_prompt_tokens", "Prompt tokens by where placement "
                                            "had them computed (remote: another worker than the decoding one; "
                                            "local: the decoding one): the effective P:D mix",
                                            ["role", "where"], registry=r)
        self.streams_moved = Counter("pdmesh_streams_moved", "Decode streams moved to another worker mid-flight "
                                     "because a prompt computed on theirs would break their TPOT SLO", ["role"],
                                     registry=r)
        self.healthy = Gauge("pdmesh_worker_healthy", "1 while the process serves", ["role"], registry=r)
        self.redis_rejected = Gauge("pdmesh_redis_rejected_entries", "Entries read from Redis and ignored so far: "
                                    "no valid mesh signature, or not under their own key", ["role", "source"],
                                    registry=r)

    def serve(self, host: str, port: int) -> str:
        """Starts the /metrics HTTP endpoint; returns host:port bound."""
        server, _ = start_http_server(port, addr=host, registry=self.registry)
        return f"{host}:{server.server_port}"

    def on_scrape(self, callback: Callable[[], None]) -> None:
        """Runs callback at the start of every scrape (from the HTTP server's thread)."""
        self._scrape_hooks.callbacks.append(callback)


class _ScrapeHooks:
    def __init__(self) -> None:
        self.callbacks: list[Callable[[], None]] = []

    def collect(self):
        for callback in self.callbacks:
            callback()
        return []

    def describe(self):
        return []

"""What the adaptive mesh did at a point, from its gateway's Prometheus counters (read before and
after the point): prompt tokens computed on the decoding worker (local) or on another (remote), the
streams moved mid-flight, and the placements by reason. The report shows it beside the figures, so
a ratio can be read against the P:D mix that produced it."""

from __future__ import annotations

import urllib.request
from collections import Counter

from prometheus_client.parser import text_string_to_metric_families

PLACED = "pdmesh_placed_prompt_tokens_total"
MOVED = "pdmesh_streams_moved_total"
DECISIONS = "pdmesh_disagg_decisions_total"


def read_counters(metrics_url: str, timeout_s: float = 5.0) -> Counter:
    """{"local_tokens", "remote_tokens", "moved", "reason:<why>"}: the gateway's totals so far."""
    with urllib.request.urlopen(f"{metrics_url}/metrics", timeout=timeout_s) as response:
        return counters_of(response.read().decode())


def counters_of(text: str) -> Counter:
    """read_counters' totals from a /metrics page's text."""
    found: Counter = Counter()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == PLACED:
                found[f"{sample.labels['where']}_tokens"] += sample.value
            elif sample.name == MOVED:
                found["moved"] += sample.value
            elif sample.name == DECISIONS:
                found[f"reason:{sample.labels['reason']}"] += sample.value
    return found


def mix_between(before: Counter, after: Counter) -> dict[str, float]:
    """What changed over a point (counters only grow; a key that did not is left out)."""
    return {key: after[key] - before.get(key, 0.0) for key in sorted(after) if after[key] > before.get(key, 0.0)}


def remote_share(mix: dict[str, float]) -> float:
    """Share of the point's prompt tokens computed on another worker than the one decoding them."""
    total = mix.get("local_tokens", 0.0) + mix.get("remote_tokens", 0.0)
    return mix.get("remote_tokens", 0.0) / total if total else 0.0

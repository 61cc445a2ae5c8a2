"""The Grafana dashboard only queries metrics pdmesh exports."""

import json
import re
from pathlib import Path

from pdmesh.telemetry.metrics import MeshMetrics

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "pdmesh-dashboard.json"
SUFFIXES = ("_bucket", "_count", "_sum", "_total")


def _exported_names() -> set[str]:
    return {family.name for family in MeshMetrics("any").registry.collect()}


def _base(name: str) -> str:
    for suffix in SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def test_every_queried_metric_is_exported():
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    queried = {_base(name) for expr in exprs for name in re.findall(r"pdmesh_[a-z_]+", expr)}
    assert queried <= _exported_names(), queried - _exported_names()
    assert {"pdmesh_ttft_seconds", "pdmesh_itl_seconds", "pdmesh_requests", "pdmesh_kv_transfer_bytes",
            "pdmesh_kv_transfer_gbps", "pdmesh_kv_cache_hit_tokens", "pdmesh_kv_tier_occupancy_bytes",
            "pdmesh_engine_queue_depth", "pdmesh_worker_healthy"} <= queried


def test_panels_use_the_datasource_variable_and_do_not_overlap():
    dashboard = json.loads(DASHBOARD.read_text())
    positions = [(p["gridPos"]["x"], p["gridPos"]["y"]) for p in dashboard["panels"]]
    assert len(set(positions)) == len(positions)
    assert all(p["datasource"]["uid"] == "${datasource}" for p in dashboard["panels"])

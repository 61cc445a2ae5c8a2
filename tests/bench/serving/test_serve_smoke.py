"""The serving benchmark end to end on real engines, its smoke profile (a few requests a point:
the path stays tested; its figures are no steady state): a monolithic vLLM arm against the
adaptive mesh, one repeat, report written with the mesh's placements."""

import json

import pytest

from bench.serve import main

pytestmark = pytest.mark.vllm


def test_the_smoke_profile_runs_every_kind_of_point_and_writes_its_report(tmp_path, tiny_llama_dir):
    main(["--profile", "smoke", "--arms", "vllm-1core,pdmesh-adaptive", "--repeats", "1", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "serving_smoke.json").read_text())["rows"]
    assert sorted((r["arm"], r["workload"]) for r in rows) == [
        ("pdmesh-adaptive", "short"), ("pdmesh-adaptive", "trace"), ("vllm-1core", "short"), ("vllm-1core", "trace")]
    assert all(r["num_sent"] == 8 and r["num_failed"] == 0 and len(r["timings"]) == 8 for r in rows)
    assert all(r["output_tokens"] > 0 and r["code"] and r["machine"] for r in rows)
    mesh_mix = [r["mix"] for r in rows if r["arm"] == "pdmesh-adaptive"]
    assert all(m.get("local_tokens", 0) + m.get("remote_tokens", 0) >= 8 * 100 for m in mesh_mix), mesh_mix
    assert not any(r["mix"] for r in rows if r["arm"] == "vllm-1core")
    report = (tmp_path / "serving_smoke.md").read_text()
    assert "pdmesh-adaptive ÷ the best of vllm-1core" in report and "| short | 4 | pdmesh-adaptive |" in report

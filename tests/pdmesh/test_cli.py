"""The README's user flow: `pdmesh up` starts the cluster and answers, `pdmesh generate` talks
to it, Ctrl-C stops every process it started."""

from __future__ import annotations

import json
import re
import shutil
import urllib.request
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pdmesh.weights_digest import CACHE_NAME, weights_digest
from tests.pdmesh.listening import listening_sockets, process_tree

pytestmark = pytest.mark.vllm
PDMESH = [sys.executable, "-m", "pdmesh.cli"]


def _read_until(process: subprocess.Popen, pattern: str, timeout_s: float) -> tuple[list[str], re.Match]:
    lines, deadline = [], time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            break
        lines.append(line)
        match = re.search(pattern, line)
        if match:
            return lines, match
    raise AssertionError(f"no line matching {pattern!r} in:\n{''.join(lines)}")


def _post_json(url: str, body: dict) -> dict:
    """What curl would do: POST a JSON body, read the JSON answer."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def _processes_of(run_dir: Path, but: int) -> list[str]:
    """Pids whose command line names run_dir (the cluster's processes), except `but`."""
    out = subprocess.run(["pgrep", "-f", "--", f"--ready_file {run_dir}"], capture_output=True, text=True)
    return [pid for pid in out.stdout.split() if pid != str(but)]


def _ctrl_c_reaches_it() -> None:
    """A terminal's Ctrl-C, even when this suite runs as a background job (which ignores SIGINT, and
    a Python started with it ignored never turns it into KeyboardInterrupt)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _pdmesh_up(model_dir: Path, run_dir: Path, *flags: str) -> subprocess.Popen:
    return subprocess.Popen([*PDMESH, "up", "--model", str(model_dir), "--port", "0",
                             "--max-tokens", "8", "--http-port", "0", "--run-dir", str(run_dir), *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=_ctrl_c_reaches_it)


def test_up_demo_generate_and_ctrl_c(tiny_llama_dir, tmp_path):
    """The default: two workers taking both roles, placed by the gateway; an idle mesh serves a short
    prompt whole on one worker."""
    run_dir = tmp_path / "run"
    up = _pdmesh_up(tiny_llama_dir, run_dir)
    try:
        lines, serving = _read_until(up, r"--gateway (127\.0\.0\.1:\d+)", timeout_s=300)
        demo = "".join(lines)
        assert "starting gateway + 2 workers taking both roles" in demo
        assert "> Hello world, the kalo mine is ready." in demo
        assert re.search(r"\[8 tokens in [\d.]+s; served whole on 127\.0\.0\.1:\d+, "
                         r"0 of 18 prompt tokens from its cache\]", demo)
        assert re.search(r"gateway http://127\.0\.0\.1:\d+/metrics", demo)
        generated = subprocess.run([*PDMESH, "generate", "Hello world", "--gateway", serving.group(1),
                                    "--max-tokens", "5"], capture_output=True, text=True, timeout=60)
        assert generated.returncode == 0, generated.stderr
        assert re.search(r"\[5 tokens in [\d.]+s; served whole on 127\.0\.0\.1:\d+", generated.stdout)
        http = re.search(r"OpenAI API (http://127\.0\.0\.1:\d+/v1)", demo).group(1)
        completion = _post_json(f"{http}/completions", {"prompt": "Hello world", "max_tokens": 5, "temperature": 0})
        assert (completion["usage"]["prompt_tokens"], completion["usage"]["completion_tokens"]) == (4, 5)
        assert len(_processes_of(run_dir, but=up.pid)) == 3  # gateway, two workers
        _assert_nothing_listens_beyond_loopback(up.pid)
        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=90) == 0
        assert _processes_of(run_dir, but=up.pid) == []
    finally:
        _stop(up)


def test_up_static_split_moves_the_demo_prompts_kv(tiny_llama_dir, tmp_path):
    run_dir = tmp_path / "run"
    up = _pdmesh_up(tiny_llama_dir, run_dir, "--prefill", "1", "--decode", "1", "--exit-after-demo")
    try:
        demo, _ = up.communicate(timeout=300)
        assert up.returncode == 0, demo
        assert "starting gateway + 1 prefill + 1 decode" in demo
        assert "KV moved: 1 blocks, 131072 bytes; decode reused 18 of 18 prompt tokens]" in demo
        assert _processes_of(run_dir, but=up.pid) == []
    finally:
        _stop(up)


def test_up_refuses_both_role_workers_and_a_static_split_at_once(tiny_llama_dir, tmp_path):
    up = _pdmesh_up(tiny_llama_dir, tmp_path / "run", "--workers", "2", "--prefill", "1")
    out, _ = up.communicate(timeout=60)
    assert up.returncode == 1
    assert "--workers (both roles) or --prefill/--decode (a static split), not both" in out


def _stop(up: subprocess.Popen) -> None:
    if up.poll() is None:
        up.kill()  # its cluster's processes see their parent gone and stop (--exit_with_parent)
        up.wait()


def _assert_nothing_listens_beyond_loopback(pid: int) -> None:
    """Every socket the cluster's processes (engines included) listen on or bind is on loopback: before
    Mooncake was opt-in, its engine listened on 0.0.0.0 and [::] in both workers (issue 30, item 1)."""
    sockets = listening_sockets(process_tree(pid))
    assert len({s.port for s in sockets if s.protocol.startswith("tcp")}) >= 6  # gateway gRPC/HTTP/metrics, workers'
    assert [s for s in sockets if not s.loopback_only] == []


def test_build_models_tokenizer_only_writes_the_tiny_llamas_tokenizer_without_torch(tiny_llama_dir, tmp_path):
    """What the slim gateway image runs: the same tokenizer files, torch never imported."""
    code = ("import sys, runpy; sys.argv = ['pdmesh', 'build-models', '--tokenizer-only', '--out', sys.argv[1]]; "
            "sys.modules['torch'] = None\ntry:\n runpy.run_module('pdmesh.cli', run_name='__main__')\n"
            "except SystemExit as exc:\n assert not exc.code, exc.code")
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True, timeout=120)
    written = sorted(p.name for p in (tmp_path / "tiny-llama").iterdir())
    assert written == ["special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"]
    for name in written:
        assert (tmp_path / "tiny-llama" / name).read_bytes() == (tiny_llama_dir / name).read_bytes()


def test_digest_weights_writes_the_cache_a_worker_then_reads(tiny_llama_dir, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, model, ignore=shutil.ignore_patterns(CACHE_NAME))
    result = subprocess.run([sys.executable, "-m", "pdmesh.cli", "digest-weights", str(model)], check=True,
                            capture_output=True, text=True, timeout=120)
    assert (model / CACHE_NAME).exists()
    assert result.stdout.split()[0] == weights_digest(model)

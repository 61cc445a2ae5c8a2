"""LocalCluster's process handling, with plain processes standing in for workers."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from pdmesh.cluster import LocalCluster, _Process


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _group_gone(pgid: int, timeout_s: float = 5.0) -> bool:
    """True once no process of the group is left (killed ones linger until their parent reaps them)."""
    deadline = time.monotonic() + timeout_s
    while _group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not _group_alive(pgid)


def _spawn(tmp_path: Path, script: str) -> _Process:
    popen = subprocess.Popen(["bash", "-c", script], start_new_session=True)
    return _Process("worker", popen, tmp_path / "ready", tmp_path / "log")


def test_kill_reaches_processes_that_outlive_the_group_leader(tmp_path):
    """A worker's engine core runs in the worker's process group; it must die with the group even
    when the worker process itself has already exited."""
    cluster = LocalCluster(tmp_path, tmp_path)
    process = _spawn(tmp_path, "sleep 300 & exit 0")
    process.popen.wait()
    assert _group_alive(process.popen.pid)   # the orphaned sleep keeps the group
    cluster._processes.append(process)
    cluster.kill("worker")
    assert _group_gone(process.popen.pid)


def test_stop_kills_a_worker_that_ignores_sigterm_after_the_grace_period(tmp_path):
    cluster = LocalCluster(tmp_path, tmp_path)
    process = _spawn(tmp_path, "trap '' TERM; sleep 300 & wait")
    cluster._processes.append(process)
    time.sleep(0.2)   # the trap is set
    started = time.monotonic()
    cluster.stop(grace_s=0.5)
    assert process.popen.returncode == -signal.SIGKILL
    assert 0.5 <= time.monotonic() - started < 5
    assert cluster._processes == []
    assert _group_gone(process.popen.pid)


def test_stop_kills_what_a_worker_that_exited_on_sigterm_left_in_its_group(tmp_path):
    """A worker stopped while its engine was starting exited on SIGTERM and left the engine's
    processes running (found after a fault-campaign trial whose restart timed out)."""
    cluster = LocalCluster(tmp_path, tmp_path)
    process = _spawn(tmp_path, "sleep 300 & trap 'exit 0' TERM; wait")
    cluster._processes.append(process)
    time.sleep(0.2)   # the trap is set
    cluster.stop(grace_s=5.0)
    assert process.popen.returncode == 0   # it exited on its own
    assert _group_gone(process.popen.pid)


@pytest.fixture
def ctrl_c_raises():
    """Ctrl-C raises KeyboardInterrupt, even when the suite runs as a background job (SIGINT ignored)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_a_second_ctrl_c_during_stop_kills_what_is_left_at_once(tmp_path, ctrl_c_raises):
    cluster = LocalCluster(tmp_path, tmp_path)
    process = _spawn(tmp_path, "trap '' TERM; sleep 300 & wait")
    cluster._processes.append(process)
    time.sleep(0.2)
    ctrl_c = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT))
    ctrl_c.start()
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        cluster.stop(grace_s=60)
    ctrl_c.join()
    assert time.monotonic() - started < 5
    assert process.popen.returncode == -signal.SIGKILL
    assert _group_gone(process.popen.pid)


def test_workers_taking_both_roles_take_the_cores_in_turn_and_the_split_keeps_its_halves():
    from pdmesh.cluster import core_of

    assert [core_of("both", i, 2) for i in range(3)] == [0, 1, 0]
    assert (core_of("prefill", 0, 2), core_of("decode", 0, 2), core_of("decode", 1, 4)) == (0, 1, 3)


def test_a_workers_flags_put_the_callers_after_the_clusters_defaults_on_a_port_a_restart_can_bind(tmp_path,
                                                                                                  monkeypatch):
    spawned: dict[str, list[str]] = {}
    cluster = LocalCluster(tmp_path / "model", tmp_path / "run", num_prefill=0, num_decode=0, num_both=1,
                           worker_args=["--process_cpus", ""], args_by_name={"node-0": ["--kv_port", "20001"]})
    monkeypatch.setattr(cluster, "_spawn", lambda name, command, env=None, restart=False: spawned.update(
        {name: command}))
    cluster._spawn_worker("both", 0, 20000)
    (command,) = spawned.values()
    assert command[command.index("--port") + 1] == "20000"
    # the cluster pins the worker to its core; the caller's flag, later, wins (the last value counts)
    assert [command[i + 1] for i, flag in enumerate(command) if flag == "--process_cpus"] == ["0", ""]
    assert command[-2:] == ["--kv_port", "20001"]

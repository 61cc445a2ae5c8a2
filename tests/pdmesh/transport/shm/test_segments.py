"""Shared-memory files of pdmesh processes that died are swept by the next one; the living keep theirs."""

import subprocess
import sys

from pdmesh.transport.shm import segments


def _dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_the_files_of_a_process_that_died_are_removed_and_nothing_else(tmp_path, monkeypatch):
    namespace = f"ns {segments.pid_namespace()}"
    dead, other_namespace, alive = _dead_pid(), _dead_pid(), 1  # pid 1 lives
    files = {name: tmp_path / name for name in ("kv-dead", "kv-other", "kv-alive", "unrelated")}
    for path in files.values():
        path.write_bytes(b"x" * 10)
    (tmp_path / f"pdmesh-owned-{dead}").write_text(f"{namespace}\n{files['kv-dead']}\n{tmp_path / 'gone'}\n/etc/hostname\n")
    (tmp_path / f"pdmesh-owned-{other_namespace}").write_text(f"ns pid:[1]\n{files['kv-other']}\n")
    (tmp_path / f"pdmesh-owned-{alive}").write_text(f"{namespace}\n{files['kv-alive']}\n")
    assert segments.sweep(tmp_path) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["kv-other", "kv-alive", "unrelated", f"pdmesh-owned-{other_namespace}", f"pdmesh-owned-{alive}"])


def test_a_process_records_what_it_shares_under_its_own_pid(tmp_path, monkeypatch):
    monkeypatch.setattr(segments, "SHM_DIR", tmp_path)
    segments.record([tmp_path / "a", tmp_path / "b"])
    segments.record([tmp_path / "c"])
    lines = (tmp_path / f"pdmesh-owned-{__import__('os').getpid()}").read_text().splitlines()
    assert lines == [f"ns {segments.pid_namespace()}", str(tmp_path / "a"), str(tmp_path / "b"), str(tmp_path / "c")]


def test_lists_and_files_of_another_user_are_left_alone(tmp_path):
    import os

    import pytest

    if os.getuid() != 0:
        pytest.skip("needs root to hand files to another user")
    namespace = f"ns {segments.pid_namespace()}"
    theirs, ours = _dead_pid(), _dead_pid()
    files = {name: tmp_path / name for name in ("kv-theirs", "kv-foreign-in-ours", "kv-ours")}
    for path in files.values():
        path.write_bytes(b"x")
    (tmp_path / f"pdmesh-owned-{theirs}").write_text(f"{namespace}\n{files['kv-theirs']}\n")
    (tmp_path / f"pdmesh-owned-{ours}").write_text(f"{namespace}\n{files['kv-foreign-in-ours']}\n{files['kv-ours']}\n")
    os.chown(tmp_path / f"pdmesh-owned-{theirs}", 4321, 4321)
    os.chown(files["kv-foreign-in-ours"], 4321, 4321)
    assert segments.sweep(tmp_path) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["kv-theirs", "kv-foreign-in-ours", f"pdmesh-owned-{theirs}"])

"""What SIGKILLed engines leave in /dev/shm and /tmp is swept; what a live process holds, in any
namespace, another user's files, links and fresh files are not. Real files in stand-in directories,
real processes holding them, killed with SIGKILL."""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest

from pdmesh import engine_debris
from pdmesh.cluster import LocalCluster, _Process
from pdmesh.transport.shm.segments import pid_namespace
from worker.vllm_ext.worker_ext import PDMeshWorkerExtension

ROOT = Path(__file__).resolve().parents[2]
STORE = "vllm_dist_" + "ab" * 16
# A child that holds files as an engine does, then sleeps: map=PATH (mmap, descriptor closed),
# open=PATH, listen=PATH (a unix socket), create=PATH (new shared memory, mapped), store=PATH (a
# FileStore, recorded by this process as a worker records its engine's).
HOLDER = """
import mmap, os, socket, sys, time
from pdmesh import engine_debris
held = []
for arg in sys.argv[1:]:
    how, path = arg.split("=", 1)
    if how in ("map", "create"):
        fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if how == "create" else 0), 0o600)
        os.ftruncate(fd, 4096)
        held.append(mmap.mmap(fd, 4096))
        os.close(fd)
    elif how == "open":
        held.append(os.open(path, os.O_RDONLY))
    elif how == "listen":
        os.makedirs(os.path.dirname(path), exist_ok=True)
        held.append(socket.socket(socket.AF_UNIX))
        held[-1].bind(path)
        held[-1].listen()
    elif how == "store":
        open(path, "wb").close()
        engine_debris.record_stores([path, ""])
print("ready", flush=True)
time.sleep(600)
"""


@pytest.fixture
def shm():
    """A stand-in for /dev/shm (tmpfs, as /dev/shm is)."""
    path = Path(tempfile.mkdtemp(prefix="pdmesh-test-", dir="/dev/shm"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def temp():
    """A stand-in for /tmp, short enough for unix socket paths."""
    path = Path(tempfile.mkdtemp(prefix="dbr", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def start(*actions: str, prefix: list[str] | None = None) -> subprocess.Popen:
    child = subprocess.Popen([*(prefix or []), sys.executable, "-c", HOLDER, *actions], cwd=ROOT,
                             stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert child.stdout.readline() == "ready\n"
    return child


def kill(child: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(child.pid, signal.SIGKILL)
    child.wait()


@contextlib.contextmanager
def holding(*actions: str, prefix: list[str] | None = None):
    child = start(*actions, prefix=prefix)
    try:
        yield child
    finally:
        kill(child)


def dead_socket(path: Path) -> None:
    """A socket file whose listener was SIGKILLed: the file stays."""
    kill(start(f"listen={path}"))


def files(directory: Path, **contents: bytes) -> dict[str, Path]:
    for name, data in contents.items():
        (directory / name).write_bytes(data)
    return {name: directory / name for name in contents}


def names(directory: Path) -> list[str]:
    return sorted(os.listdir(directory))


def test_unused_shm_files_of_engine_kinds_are_removed_and_held_ones_kept(shm):
    cpushm = STORE + "-tp:0-[0-1]-cpushm_0"
    made = files(shm, psm_0000dead=b"", psm_000a11ce=b"x" * 4096, psm_0000f11e=b"", **{
        "sem.mp-ab_9xyz0": b"", "torch_41_3001_0": b"", cpushm: b"", "psm_xyz": b"", "notes": b""})
    with holding(f"map={made['psm_000a11ce']}", f"open={made['psm_0000f11e']}"):
        removed = engine_debris.sweep(shm, temp=[], grace_s=0)
    assert sorted(removed) == sorted(shm / n for n in ("psm_0000dead", "sem.mp-ab_9xyz0", "torch_41_3001_0", cpushm))
    assert names(shm) == ["notes", "psm_0000f11e", "psm_000a11ce", "psm_xyz"]


def test_a_file_is_swept_once_the_process_mapping_it_is_killed(shm):
    path = files(shm, psm_00c0ffee=b"x" * 4096)["psm_00c0ffee"]
    child = start(f"map={path}")
    try:
        assert engine_debris.sweep(shm, temp=[], grace_s=0) == []
    finally:
        kill(child)
    assert engine_debris.sweep(shm, temp=[], grace_s=0) == [path]


def test_dead_sockets_are_removed_and_listening_ones_kept(shm, temp):
    live, dead, bound_elsewhere = (temp / str(uuid.uuid4()) for _ in range(3))
    dead_socket(dead)
    dead_socket(temp / "engine.sock")        # not a name vLLM gives
    files(temp, **{str(uuid.uuid4()): b""})  # a regular file named like a socket
    with holding(f"listen={live}"):
        assert engine_debris.sweep(shm, temp=[temp], grace_s=0) == [dead]
        assert live.exists()
    assert engine_debris.sweep(shm, temp=[temp], grace_s=0) == [live]
    assert len(names(temp)) == 2 and "engine.sock" in names(temp)


def test_torch_shm_manager_directories_go_when_their_manager_is_dead(shm, temp):
    dead, live, crowded, empty = (temp / f"torch-shm-dir-{tag}" for tag in ("Dead01", "Live02", "Full03", "Empt04"))
    dead_socket(dead / "manager.sock")
    dead_socket(crowded / "manager.sock")
    (crowded / "other").write_bytes(b"")
    empty.mkdir()
    with holding(f"listen={live / 'manager.sock'}"):
        assert sorted(engine_debris.sweep(shm, temp=[temp], grace_s=0)) == [dead, empty]
        assert names(temp) == ["torch-shm-dir-Full03", "torch-shm-dir-Live02"]
        assert names(live) == ["manager.sock"]


def test_the_filestores_of_gone_workers_are_removed(shm, temp):
    gone, unrecorded, ours = temp / STORE, temp / ("vllm_dist_" + "cd" * 16), temp / ("vllm_dist_" + "ef" * 16)
    kill(start(f"store={gone}"))
    unrecorded.write_bytes(b"")
    ours.write_bytes(b"")
    engine_debris.record_stores([str(ours)])   # this process lives
    foreign = temp / "pdmesh-engine-stores-1"  # pid 1 lives; and another namespace's record
    other_namespace = temp / f"pdmesh-engine-stores-{_dead_pid()}"
    other_namespace.write_text(f"ns pid:[1]\n{unrecorded.name}\n")
    foreign.write_text(f"ns {pid_namespace()}\n{unrecorded.name}\n")
    assert engine_debris.sweep(shm, temp=[temp], grace_s=0) == [gone]
    assert names(temp) == sorted([unrecorded.name, ours.name, f"pdmesh-engine-stores-{os.getpid()}",
                                  foreign.name, other_namespace.name])


def test_a_record_names_files_of_its_own_directory_only(shm, temp):
    outside = files(shm, **{STORE: b""})[STORE]
    record = temp / f"pdmesh-engine-stores-{_dead_pid()}"
    record.write_text(f"ns {pid_namespace()}\n{outside}\n../{shm.name}/{STORE}\nnotes\n")
    files(temp, notes=b"")
    assert engine_debris.sweep(shm, temp=[temp], grace_s=0) == []
    assert outside.exists() and names(temp) == ["notes"]


def test_files_changed_within_the_grace_are_kept(shm, temp):
    made = files(shm, psm_0000fe57=b"")
    dead_socket(temp / str(uuid.uuid4()))
    assert engine_debris.sweep(shm, temp=[temp], grace_s=60) == []
    assert len(engine_debris.sweep(shm, temp=[temp], grace_s=0)) == 2 and not made["psm_0000fe57"].exists()


def test_links_named_like_debris_are_not_followed_or_removed(shm, temp):
    target = files(shm, target=b"kept")["target"]
    (shm / "psm_0001ee75").symlink_to(target)
    dead_socket(temp / "real.sock")
    (temp / str(uuid.uuid4())).symlink_to(temp / "real.sock")
    (temp / "torch-shm-dir-Link05").symlink_to(temp)
    assert engine_debris.sweep(shm, temp=[temp], grace_s=0) == []
    assert target.read_bytes() == b"kept" and len(names(shm)) == 2 and len(names(temp)) == 3


def test_another_users_files_are_left_alone(shm, temp):
    if os.getuid() != 0:
        pytest.skip("needs root to hand files to another user")
    made = files(shm, psm_000ba5e0=b"", psm_0000a1de=b"")
    theirs_socket = temp / str(uuid.uuid4())
    dead_socket(theirs_socket)
    theirs_dir = temp / "torch-shm-dir-Them06"
    theirs_dir.mkdir()
    for path in (made["psm_000ba5e0"], theirs_socket, theirs_dir):
        os.chown(path, 65534, 65534, follow_symlinks=False)
    assert engine_debris.sweep(shm, temp=[temp], grace_s=0) == [made["psm_0000a1de"]]
    assert names(shm) == ["psm_000ba5e0"] and len(names(temp)) == 2


def test_what_a_process_of_another_namespace_holds_is_kept(shm, temp):
    """The sweep runs in a new PID and network namespace (with its own /proc), where the holder is
    invisible: the kernel still tells the held file and the listening socket from dead ones."""
    if os.getuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1)")
    made = files(shm, psm_000e1d00=b"x" * 4096, psm_0000dead=b"")
    live, dead = temp / str(uuid.uuid4()), temp / str(uuid.uuid4())
    dead_socket(dead)
    sweep_elsewhere = ("import os, sys; from pathlib import Path; from pdmesh import engine_debris; "
                       "assert os.getpid() == 1 and len([p for p in os.listdir('/proc') if p.isdigit()]) == 1; "
                       "print(*sorted(engine_debris.sweep(Path(sys.argv[1]), [Path(sys.argv[2])], 0)))")
    with holding(f"map={made['psm_000e1d00']}", f"listen={live}"):
        swept = subprocess.run(["unshare", "--pid", "--net", "--fork", "--mount-proc", sys.executable, "-c",
                                sweep_elsewhere, str(shm), str(temp)], cwd=ROOT, capture_output=True, text=True)
        assert swept.returncode == 0, swept.stderr
        assert swept.stdout.split() == [str(made["psm_0000dead"]), str(dead)]
        assert names(shm) == ["psm_000e1d00"] and names(temp) == [live.name]


def test_a_kill_loop_ends_with_the_directories_as_they_began(shm, temp):
    """Engines are SIGKILLed with their process group three times while a neighbour's engine runs:
    each kill leaves its shared memory, socket, manager directory and FileStore; each sweep removes
    exactly those."""
    with holding(f"create={shm / 'psm_00ab0001'}", f"listen={temp / str(uuid.uuid4())}"):
        began = (names(shm), names(temp))
        for _ in range(3):
            engine = start(f"create={shm / f'psm_{uuid.uuid4().hex[:8]}'}",
                           f"create={shm / f'sem.mp-{uuid.uuid4().hex[:8]}'}",
                           f"listen={temp / str(uuid.uuid4())}",
                           f"listen={temp / f'torch-shm-dir-{uuid.uuid4().hex[:6]}' / 'manager.sock'}",
                           f"store={temp / f'vllm_dist_{uuid.uuid4().hex}'}")
            kill(engine)
            left = (set(names(shm)) - set(began[0]), set(names(temp)) - set(began[1]))
            assert (len(left[0]), len(left[1])) == (2, 4)   # the control: the kill left them
            assert len(engine_debris.sweep(shm, temp=[temp], grace_s=0)) == 5
            assert (names(shm), names(temp)) == began


@pytest.mark.parametrize("end", ["kill", "stop"])
def test_local_cluster_sweeps_what_its_killed_workers_left(shm, temp, tmp_path, monkeypatch, end):
    monkeypatch.setattr(engine_debris, "sweep", functools.partial(engine_debris.sweep, shm, [temp], 0))
    cluster = LocalCluster(tmp_path, tmp_path)
    worker = start(f"create={shm / 'psm_0000beef'}", f"listen={temp / str(uuid.uuid4())}")
    cluster._processes.append(_Process("worker", worker, tmp_path / "ready", tmp_path / "log"))
    cluster.kill("worker") if end == "kill" else cluster.stop()   # stop: SIGTERM, which it does not handle
    assert (names(shm), names(temp)) == ([], [])


async def test_a_worker_sweeps_once_its_engine_has_died(shm, temp):
    path = files(shm, psm_0000dead=b"")["psm_0000dead"]
    polls = []
    removed = await engine_debris.sweep_after_death(lambda: polls.append(1) or len(polls) > 3, poll_s=0.01,
                                                    settle_s=0.0, shm_dir=shm, temp=[temp])
    assert (removed, len(polls)) == ([path], 4)


@pytest.mark.parametrize(("init_method", "store"), [(f"file:///tmp/{STORE}", f"/tmp/{STORE}"),
                                                   ("tcp://127.0.0.1:29500", ""), (None, "")])
def test_an_engine_worker_tells_the_file_of_its_filestore(init_method, store):
    worker = PDMeshWorkerExtension()
    worker.distributed_init_method = init_method
    assert worker.pdmesh_dist_store() == store


def test_the_temp_dirs_are_vllms_rpc_path_and_the_temp_dir(monkeypatch):
    monkeypatch.setenv("VLLM_RPC_BASE_PATH", "/run/engine-rpc")
    assert engine_debris.temp_dirs() == (Path("/run/engine-rpc"), Path(tempfile.gettempdir()))
    monkeypatch.delenv("VLLM_RPC_BASE_PATH")
    assert engine_debris.temp_dirs() == (Path(tempfile.gettempdir()),)


def _dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid

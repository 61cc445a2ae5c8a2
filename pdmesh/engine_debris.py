"""What a SIGKILLed vLLM engine leaves on its host (killed with its worker's process group, by the OOM
killer, by a supervisor), and its removal by the next worker to start there, by a worker whose engine
died, and by LocalCluster. A TP engine's two ring buffers alone hold 400 MiB of /dev/shm: a worker in a
restart loop fills it until engines cannot start.

What an engine creates (vLLM 0.32, torch 2.13, CPython 3.11) and what is swept:
- /dev/shm/psm_<8 hex>: multiprocessing.shared_memory: vLLM's MessageQueue ring buffers, its shm
  object storage and tensor arena, its same-node probe.
- /dev/shm/sem.mp-<8>: multiprocessing's named semaphores (the resource tracker that would unlink them
  and the psm_ files is killed with the group).
- /dev/shm/torch_<pid>_<n>_<n>: torch's file_system sharing (pdmesh's shared KV cache, which
  pdmesh.transport.shm.segments also records).
- /dev/shm/vllm_dist_<32 hex>-*: vLLM's CPU shared-memory communicator (TP or PP > 1 on CPU).
- <VLLM_RPC_BASE_PATH or temp dir>/<uuid4>: vLLM's ZMQ ipc sockets, several per engine.
- <temp dir>/torch-shm-dir-<6>/manager.sock: the socket of torch's shm manager.
- <temp dir>/vllm_dist_<32 hex>: the FileStore of the engine's torch.distributed rendezvous.
(Caches, such as torchinductor_<user>, are kept on purpose.)

Which are dead is asked of the kernel, not of /proc or of a pid in a name: a process of another PID
or network namespace sharing /dev/shm or /tmp (containers of one pod) is invisible in /proc.
- A regular file is dead when this process can take a write lease on it: the kernel grants one only
  while no other open file refers to it, by a descriptor or by a mapping, in any namespace.
- A socket is dead when a connection to it is refused: nothing listens on that file, in any network
  namespace (those bound in ours are skipped untouched).
- A FileStore is opened for each operation only, so nothing tells a live one: the worker records its
  engine's (record_stores) and a sweep removes those of workers gone from this PID namespace, as
  segments.py does. One killed before its engine was ready leaves its FileStore (2 KB).
Only this user's files, never a link, and none changed in the last GRACE_S (a socket is bound a moment
before it listens). Sweeping is best effort: it never fails a worker."""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import re
import signal
import socket
import stat
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from pdmesh.transport.shm.segments import pid_namespace, process_alive

logger = logging.getLogger(__name__)
SHM_DIR = Path("/dev/shm")
GRACE_S = 5.0
_SHM_NAMES = re.compile(r"psm_[0-9a-f]{8}|sem\.mp-[a-z0-9_]{8}|torch_\d+_\d+_\d+|vllm_dist_[0-9a-f]{32}-.+")
_SOCKET_NAMES = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}")
_MANAGER_DIRS = re.compile(r"torch-shm-dir-[A-Za-z0-9]{6}")
_MANAGER_SOCKET = "manager.sock"
_STORE_NAMES = re.compile(r"vllm_dist_[0-9a-f]{32}")
_RECORD_PREFIX = "pdmesh-engine-stores-"


def temp_dirs() -> tuple[Path, ...]:
    """Where engines started from this process's environment put their sockets and stores."""
    temp = Path(tempfile.gettempdir())
    return tuple(dict.fromkeys([Path(os.environ.get("VLLM_RPC_BASE_PATH") or temp), temp]))


def sweep(shm_dir: Path = SHM_DIR, temp: Iterable[Path] | None = None, grace_s: float = GRACE_S) -> list[Path]:
    """Removes what dead engines left in shm_dir and the temp dirs; the paths removed."""
    changed_before = time.time() - grace_s
    removed = _sweep_shm_files(shm_dir, changed_before)
    for temp_dir in temp_dirs() if temp is None else temp:
        removed += _sweep_sockets(temp_dir, changed_before)
        removed += _sweep_manager_dirs(temp_dir, changed_before)
        removed += _sweep_stores(temp_dir)
    if removed:
        logger.warning("removed %d files left by vLLM engines that died", len(removed))
    return removed


async def sweep_after_death(is_dead: Callable[[], bool], poll_s: float = 1.0, settle_s: float = GRACE_S,
                            shm_dir: Path = SHM_DIR, temp: Iterable[Path] | None = None) -> list[Path]:
    """Waits for the engine to die, lets its last writes age past the grace, then sweeps."""
    while not is_dead():
        await asyncio.sleep(poll_s)
    await asyncio.sleep(settle_s)
    return await asyncio.to_thread(sweep, shm_dir, temp, settle_s)


def record_stores(paths: Iterable[str]) -> None:
    """Notes the FileStores of this process's engine ('' for none), to be removed once it is gone."""
    for path in {Path(p) for p in paths if p}:
        if _STORE_NAMES.fullmatch(path.name):
            _append_record(path.parent / f"{_RECORD_PREFIX}{os.getpid()}", path.name)


def _sweep_shm_files(shm_dir: Path, changed_before: float) -> list[Path]:
    return [path for path in _named(shm_dir, _SHM_NAMES)
            if _own(path, stat.S_IFREG, changed_before) and _unlink_if_unused(path)]


def _sweep_sockets(temp_dir: Path, changed_before: float) -> list[Path]:
    bound = _bound_socket_paths()
    return [path for path in _named(temp_dir, _SOCKET_NAMES)
            if str(path) not in bound and _own(path, stat.S_IFSOCK, changed_before) and _unlink_if_refused(path)]


def _sweep_manager_dirs(temp_dir: Path, changed_before: float) -> list[Path]:
    removed = []
    for directory in _named(temp_dir, _MANAGER_DIRS):
        if not _own(directory, stat.S_IFDIR, changed_before):
            continue
        manager = directory / _MANAGER_SOCKET
        if _manager_socket_gone(manager, changed_before) and _rmdir(directory):
            removed.append(directory)
    return removed


def _manager_socket_gone(manager: Path, changed_before: float) -> bool:
    """Whether the manager's directory holds nothing now but its dead socket, which is removed."""
    try:
        if set(os.listdir(manager.parent)) - {_MANAGER_SOCKET}:
            return False
    except OSError:
        return False
    if not os.path.lexists(manager):
        return True
    return (str(manager) not in _bound_socket_paths() and _own(manager, stat.S_IFSOCK, changed_before)
            and _unlink_if_refused(manager))


def _sweep_stores(temp_dir: Path) -> list[Path]:
    removed = []
    for record in temp_dir.glob(f"{_RECORD_PREFIX}*"):
        names = _names_left_by_gone_owner(record)
        if names is None:
            continue
        for target in (temp_dir / name for name in names if _STORE_NAMES.fullmatch(name)):
            if _own(target, stat.S_IFREG, float("inf")) and _unlink(target):
                removed.append(target)
        _unlink(record)
    return removed


def _names_left_by_gone_owner(record: Path) -> list[str] | None:
    """The names a record lists, if its writer (of this user and PID namespace) is gone; else None."""
    pid = record.name.removeprefix(_RECORD_PREFIX)
    if not pid.isdigit() or process_alive(int(pid)) or not _own(record, stat.S_IFREG, float("inf")):
        return None
    try:
        with open(os.open(record, os.O_RDONLY | os.O_NOFOLLOW)) as file:
            header, *names = file.read().splitlines()
    except (OSError, ValueError):
        return None
    return names if header == f"ns {pid_namespace()}" else None


def _append_record(record: Path, name: str) -> None:
    try:
        with open(os.open(record, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600), "a") as file:
            if os.fstat(file.fileno()).st_uid != os.getuid():
                return
            if file.tell() == 0:
                file.write(f"ns {pid_namespace()}\n")
            file.write(f"{name}\n")
    except OSError as exc:
        logger.warning("the engine's FileStore %s not recorded for cleanup (%s)", name, exc)


def _named(directory: Path, names: re.Pattern) -> list[Path]:
    try:
        return [directory / name for name in sorted(os.listdir(directory)) if names.fullmatch(name)]
    except OSError:
        return []


def _own(path: Path, kind: int, changed_before: float) -> bool:
    """A file of this kind (not a link) and of this user, unchanged since changed_before."""
    try:
        info = path.lstat()
    except OSError:
        return False
    return (stat.S_IFMT(info.st_mode) == kind and info.st_uid == os.getuid()
            and max(info.st_mtime, info.st_ctime) < changed_before)


def _unlink_if_unused(path: Path) -> bool:
    """Unlinks a regular file while holding a write lease on it: proof that no descriptor or mapping
    anywhere refers to it. An open racing the unlink waits for the lease (a signal ignored by default
    tells us, not SIGIO, which would end this process); closing releases it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
            return False
        fcntl.fcntl(fd, fcntl.F_SETSIG, signal.SIGURG)
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)   # EAGAIN: in use
        os.unlink(path)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def _unlink_if_refused(path: Path) -> bool:
    """Unlinks a socket file nothing listens on (a connection goes by the file, in any namespace)."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.setblocking(False)
            probe.connect(str(path))
    except ConnectionRefusedError:
        return _unlink(path)
    except OSError:   # it listens (a full backlog, another socket type), or the path is too long
        return False
    return False


def _bound_socket_paths() -> set[str]:
    """Paths of the unix sockets bound in this network namespace."""
    try:
        lines = Path("/proc/net/unix").read_text().splitlines()[1:]
    except OSError:
        return set()
    return {fields[7] for fields in (line.split() for line in lines) if len(fields) > 7}


def _unlink(path: Path) -> bool:
    try:
        path.unlink()
    except OSError:
        return False
    return True


def _rmdir(path: Path) -> bool:
    try:
        path.rmdir()
    except OSError:
        return False
    return True

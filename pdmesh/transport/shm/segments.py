"""The shared-memory files this host's pdmesh processes create (a producer's KV cache moved into
/dev/shm, a KV store's export slab), recorded per process so that those of a process that died
without cleaning up (SIGKILL, the OOM killer, a killed process group that took torch's shm manager
with it) are removed by the next pdmesh process to start: each is the size of a KV cache, held in
host memory until someone unlinks it.

Only lists this user owns, of processes in this PID namespace, are swept (a process of another
namespace sharing /dev/shm would look dead from here; another user's list could name our live
files). Recording and sweeping are best effort: they never fail a worker."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable
from pathlib import Path

logger = logging.getLogger(__name__)
SHM_DIR = Path("/dev/shm")
_PREFIX = "pdmesh-owned-"
_lock = threading.Lock()


def record(paths: Iterable[Path | str]) -> None:
    """Notes shared files this process created. A process that exits cleanly unlinks them itself;
    its list stays (a few bytes) until a sweep finds the process gone."""
    lines = "".join(f"{path}\n" for path in paths)
    try:
        with _lock, open(os.open(_own_list(), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600), "a") as file:
            if file.tell() == 0:
                file.write(f"ns {pid_namespace()}\n")
            file.write(lines)
    except OSError as exc:
        logger.warning("shared-memory files not recorded for cleanup (%s)", exc)


def sweep(shm_dir: Path = SHM_DIR) -> int:
    """Removes the recorded files of processes of this PID namespace that are gone; how many."""
    removed = 0
    for owner_list in shm_dir.glob(f"{_PREFIX}*"):
        pid = owner_list.name.removeprefix(_PREFIX)
        try:
            if not pid.isdigit() or process_alive(int(pid)) or owner_list.stat().st_uid != os.getuid():
                continue
            header, *paths = owner_list.read_text().splitlines()
        except (OSError, ValueError):
            continue
        if header != f"ns {pid_namespace()}":
            continue
        for path in paths:
            target = Path(path)
            try:
                if target.parent == shm_dir and target.stat().st_uid == os.getuid():
                    target.unlink()
                    removed += 1
            except OSError:
                continue
        try:
            owner_list.unlink()
        except OSError:
            continue
    if removed:
        logger.warning("removed %d shared-memory files left by pdmesh processes that died", removed)
    return removed


def _own_list() -> Path:
    return SHM_DIR / f"{_PREFIX}{os.getpid()}"


def process_alive(pid: int) -> bool:
    """Whether a process of this PID namespace with this pid exists (one of another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def pid_namespace() -> str:
    """This process's PID namespace (what a record of pids is valid in)."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return "unknown"

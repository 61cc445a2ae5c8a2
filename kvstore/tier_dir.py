"""The NVMe tier's directory, private to the worker's user: the directory 0700 and its files 0600
whatever the umask (a block's header holds its tokens' ids: the prompt), an exclusive lock held for
the tier's life (a second tier on the directory, in this process or another worker, fails at
once), and debris removal that touches only files the tier made.

A looser directory of this user's is tightened, not refused: the directories earlier versions
created (0755 under the usual umask) and the volumes compose and k8s mount are loose by default,
not by an operator's choice, and the tier is the directory's only user, so narrowing it takes
nothing from anyone (initdb does the same to an existing data directory). A directory of another
user's is refused, as PostgreSQL refuses a data directory it does not own: its owner could widen it
again or swap the tier's files. So is a sticky one that holds anything (/tmp, /dev/shm: shared by
design, and 0700 would lock its other users out); an empty one is a fresh mount point (a tmpfs
root is 1777), tightened like any other.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import stat
from collections.abc import Callable, Iterable
from pathlib import Path

logger = logging.getLogger(__name__)

DIR_MODE = 0o700
FILE_MODE = 0o600
LOCK_NAME = "tier.lock"


class TierDirectoryError(Exception):
    """The directory is not the tier's to use: another user's, a shared one, or holding an entry
    under one of the tier's names that is not the tier's file."""


class TierDirectoryInUse(TierDirectoryError):
    """Another tier (this process's or another worker's) holds the directory's lock."""


def make_private_dir(directory: Path) -> None:
    """Creates the directory 0700, or checks an existing one is this user's and tightens it to 0700."""
    existed = directory.exists()
    directory.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        if info.st_uid != os.geteuid():
            raise TierDirectoryError(
                f"nvme: {directory} is owned by uid {info.st_uid}, not by this worker's uid {os.geteuid()}: "
                "its owner could read or swap the tier's files; point --store.nvme_dir at a directory of "
                "the worker's own (a subdirectory it may create)")
        if info.st_mode & stat.S_ISVTX and not _is_empty(fd):
            raise TierDirectoryError(f"nvme: {directory} is a shared directory (sticky bit, like /tmp): "
                                     "point --store.nvme_dir at a directory of the tier's own")
        mode = stat.S_IMODE(info.st_mode)
        if mode != DIR_MODE:
            os.fchmod(fd, DIR_MODE)
            if existed:
                logger.warning("nvme: %s was mode %04o; tightened to %04o", directory, mode, DIR_MODE)
    finally:
        os.close(fd)


def open_private(path: Path, flags: int) -> int:
    """An fd on one of the tier's files: created 0600 whatever the umask, an older one tightened to
    0600; a symlink or another user's file under the name is refused (it is not the tier's)."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise TierDirectoryError(f"nvme: {path} is a symlink, not the tier's file: remove it") from exc
        raise
    try:
        info = os.fstat(fd)
        _check_own_file(path, info)
        if stat.S_IMODE(info.st_mode) != FILE_MODE:
            os.fchmod(fd, FILE_MODE)
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_own_files(directory: Path, names: Iterable[str]) -> None:
    """Refuses the directory where an entry under one of the tier's names is not the tier's file."""
    for name in names:
        path = directory / name
        try:
            info = os.lstat(path)
        except FileNotFoundError:
            continue
        _check_own_file(path, info)


def lock_directory(directory: Path) -> int:
    """Takes the directory's exclusive lock (the fd holds it: `unlock` or the process's end frees it);
    TierDirectoryInUse at once where another tier holds it."""
    path = directory / LOCK_NAME
    fd = open_private(path, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise TierDirectoryInUse(f"nvme: {directory} is in use by another KV store tier (pid {holder} holds "
                                 f"{path}): give each worker its own --store.nvme_dir") from None
    except BaseException:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def unlock(fd: int) -> None:
    """Frees the lock even where a forked child still holds a copy of the fd, and closes it."""
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)


def remove_own_files(directory: Path, is_debris: Callable[[Path], bool]) -> list[str]:
    """Removes the regular files of this user's that is_debris names (asked only of those), never
    following a symlink; every other entry is left as it is. Returns the names removed."""
    removed = []
    for entry in os.scandir(directory):
        info = entry.stat(follow_symlinks=False)
        if stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid() and is_debris(Path(entry.path)):
            os.unlink(entry.path)
            removed.append(entry.name)
    return removed


def _is_empty(directory_fd: int) -> bool:
    with os.scandir(directory_fd) as entries:
        return next(entries, None) is None


def _check_own_file(path: Path, info: os.stat_result) -> None:
    if not stat.S_ISREG(info.st_mode):
        raise TierDirectoryError(f"nvme: {path} is not a regular file, so not the tier's: remove it")
    if info.st_uid != os.geteuid():
        raise TierDirectoryError(f"nvme: {path} is owned by uid {info.st_uid}, not the tier's "
                                 f"uid {os.geteuid()}: remove it")

"""Same-host shared memory: the producer's KV cache lives in /dev/shm (worker/paged_kv.py
share_memory); the consumer maps it read-only once per producer and copies each run of blocks
straight into its own KV cache: one copy (checksummed as it goes), no bytes through a socket."""

from __future__ import annotations

import mmap
import os
import stat
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from decode.kv.registered_reader import RegisteredMemoryReader
from pdmesh.errors import WorkerFailed
from pdmesh.kv.kv_layout import Copy
from pdmesh.transport.kv_transport import SHM, PeerLink, ReadOptions

SHM_DIR = Path("/dev/shm")
SHARED_FILE_PREFIXES = ("torch_", "pdmesh-")   # a producer's KV cache (torch's file), a KV store's export slab


class ShmKVReader(RegisteredMemoryReader):
    transport = SHM

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._lock = threading.Lock()
        self._maps: dict[str, mmap.mmap] = {}  # shm file: its read-only mapping

    def _land(self, link: PeerLink, copies: list[Copy], digests: np.ndarray | None, options: ReadOptions) -> None:
        sources = [memoryview(view) for view in self._sources(link)]
        self._copy_out(copies, [(sources[c.layer], c.src) for c in copies], digests, options)

    def _sources(self, link: PeerLink) -> Sequence[np.ndarray]:
        views = []
        for region in link.regions:
            mapping = self._map(region.shm_path)
            if region.base + region.nbytes > len(mapping):
                raise WorkerFailed(f"{region.shm_path}: region past the end of the shared file")
            views.append(np.frombuffer(mapping, dtype=np.uint8, count=region.nbytes, offset=region.base))
        return views

    def _map(self, path: str) -> mmap.mmap:
        with self._lock:
            if path not in self._maps:
                self._maps[path] = map_shared_file(path)
            return self._maps[path]

    def forget(self, link: PeerLink) -> None:
        """Unmaps a producer's cache (it restarted, or failed)."""
        with self._lock:
            for region in link.regions:
                self._maps.pop(region.shm_path, None)  # closed once no view uses it

    def close(self) -> None:
        with self._lock:
            self._maps.clear()


def map_shared_file(path: str) -> mmap.mmap:
    """Maps, read-only, a file a producer on this host named in its handshake answer: only a pdmesh or
    torch shared-memory file directly in /dev/shm, a regular file (no link followed) owned by this
    process's user. Anything else (a path a peer made up: /etc/shadow, another user's file, a link
    to one) is refused before it is opened for reading."""
    where = Path(path)
    if where.parent != SHM_DIR or not where.name.startswith(SHARED_FILE_PREFIXES):
        raise WorkerFailed(f"refused to map {path!r}: not a pdmesh shared-memory file in {SHM_DIR}")
    try:
        fd = os.open(where, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        raise WorkerFailed(f"cannot map the producer's KV cache {path}: {exc}") from exc
    try:
        status = os.fstat(fd)
        if not stat.S_ISREG(status.st_mode) or status.st_uid != os.getuid():
            raise WorkerFailed(f"refused to map {path!r}: not a regular file of this user")
        return mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
    except OSError as exc:
        raise WorkerFailed(f"cannot map the producer's KV cache {path}: {exc}") from exc
    finally:
        os.close(fd)

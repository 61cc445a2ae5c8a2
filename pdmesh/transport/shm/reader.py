"""Same-host shared memory: the producer's KV cache lives in /dev/shm (pdmesh/connector/paged_kv.py
share_memory); the consumer maps it read-only once per producer and copies each run of blocks
straight into its own KV cache: one copy (checksummed as it goes), no bytes through a socket."""

from __future__ import annotations

import mmap
import threading
from collections.abc import Sequence

import numpy as np

from pdmesh.errors import WorkerFailed
from pdmesh.transport.kv_layout import Copy
from pdmesh.transport.kv_transport import SHM, PeerLink, ReadOptions
from pdmesh.transport.registered_reader import RegisteredMemoryReader


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
                try:
                    with open(path, "rb") as file:
                        self._maps[path] = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
                except OSError as exc:
                    raise WorkerFailed(f"cannot map the producer's KV cache {path}: {exc}") from exc
            return self._maps[path]

    def forget(self, link: PeerLink) -> None:
        """Unmaps a producer's cache (it restarted, or failed)."""
        with self._lock:
            for region in link.regions:
                self._maps.pop(region.shm_path, None)  # closed once no view uses it

    def close(self) -> None:
        with self._lock:
            self._maps.clear()

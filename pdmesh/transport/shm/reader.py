"""Same-host shared memory: the producer's KV cache lives in /dev/shm (pdmesh/connector/paged_kv.py
share_memory); the consumer maps it read-only once per producer and copies each run of blocks
straight into its own KV cache: one copy, no bytes through a socket. It checksums each piece right
after copying it, while the piece is still in cache (a second pass over memory would cost about
as much as the copy)."""

from __future__ import annotations

import mmap
import threading
from collections.abc import Sequence

import numpy as np
import xxhash

from pdmesh.errors import WorkerFailed
from pdmesh.transport.kv_layout import Copy, combine, piece_index
from pdmesh.transport.kv_transport import SHM, PeerLink, ReadOptions
from pdmesh.transport.registered_reader import RegisteredMemoryReader

CHUNK_NBYTES = 256 << 10  # copied, then hashed while in cache (measured: 1 MiB chunks fall out of L2)


class ShmKVReader(RegisteredMemoryReader):
    transport = SHM

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if self._local_views is None:
            raise ValueError("shared-memory reads need the local KV cache in host memory")
        self._lock = threading.Lock()
        self._maps: dict[str, mmap.mmap] = {}  # shm file: its read-only mapping

    def _move(self, link: PeerLink, copies: list[Copy]) -> None:
        sources = self._sources(link)
        for copy in copies:
            self._local_views[copy.layer][copy.dst:copy.dst + copy.nbytes] = \
                sources[copy.layer][copy.src:copy.src + copy.nbytes]

    def _land(self, link: PeerLink, copies: list[Copy], local_block_ids: list[int],
              options: ReadOptions) -> list[int] | None:
        if not options.verify:
            return super()._land(link, copies, local_block_ids, options)
        sources, starts = self._sources(link), piece_index(self._local)
        digests = np.empty((len(local_block_ids), starts[-1] + self._local[-1].num_parts), dtype=np.uint64)
        digest = xxhash.xxh3_64_intdigest
        for copy in copies:  # memoryview slices: a numpy slice per piece costs as much as hashing it
            piece = self._local[copy.layer].part_nbytes
            chunk = max(1, CHUNK_NBYTES // piece) * piece
            src, dst = memoryview(sources[copy.layer]), memoryview(self._local_views[copy.layer])
            column = digests[copy.first:copy.first + copy.nbytes // piece, starts[copy.layer] + copy.part]
            for offset in range(0, copy.nbytes, chunk):
                end = min(copy.nbytes, offset + chunk)
                dst[copy.dst + offset:copy.dst + end] = src[copy.src + offset:copy.src + end]
                if options.tamper is not None and offset == 0 and copy.first == 0:
                    options.tamper(dst[copy.dst:copy.dst + piece])
                column[offset // piece:end // piece] = [digest(dst[at:at + piece])
                                                        for at in range(copy.dst + offset, copy.dst + end, piece)]
        return combine(digests)

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

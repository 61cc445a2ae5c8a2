"""Rows of equal size in a file under /dev/shm (readable by another process on the host by path),
or in private memory where /dev/shm is not writable."""

from __future__ import annotations

import logging
import mmap
import os
import secrets
from pathlib import Path

import numpy as np

from pdmesh.transport.shm import segments

logger = logging.getLogger(__name__)
SHM_DIR = Path("/dev/shm")


class SharedSlab:
    def __init__(self, num_rows: int, row_nbytes: int, prefix: str = "pdmesh-slab") -> None:
        path = SHM_DIR / f"{prefix}-{os.getpid()}-{secrets.token_hex(6)}"
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.ftruncate(fd, num_rows * row_nbytes)
                os.posix_fallocate(fd, 0, num_rows * row_nbytes)  # a full /dev/shm fails here, not as SIGBUS later
                mapping = mmap.mmap(fd, num_rows * row_nbytes)
            finally:
                os.close(fd)
        except OSError as exc:
            logger.warning("%s: not in shared memory (%s)", prefix, exc)
            path.unlink(missing_ok=True)
            self.path: Path | None = None
            self.rows = np.zeros((num_rows, row_nbytes), dtype=np.uint8)
            return
        self.path = path  # the shared file; None: private memory
        segments.record([path])  # swept if this process dies uncleanly
        self.rows = np.frombuffer(mapping, dtype=np.uint8).reshape(num_rows, row_nbytes)

    @property
    def address(self) -> int:
        return self.rows.ctypes.data

    def close(self) -> None:
        """Unlinks the file (mappings others hold stay valid until they drop them)."""
        if self.path is not None:
            self.path.unlink(missing_ok=True)

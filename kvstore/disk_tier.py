"""NVMe tier: one file per block in a directory, written crash-safe and checksummed.

A file is `<hash hex>.blk`: a header (magic, version, hash, parent hash, token ids, payload
size, payload xxh3-64, header xxh3-64) then the payload. It is written to a temporary name,
fsynced, renamed, and the directory fsynced, so a crash leaves either the whole block or
nothing under its final name. At start the directory is scanned: headers that verify become
blocks again (their payloads are verified on every read), anything else is deleted.
"""

from __future__ import annotations

import logging
import os
import struct
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import xxhash

from kvstore.block_hash import HASH_NBYTES
from kvstore.block_key import BlockKey
from kvstore.tier import Payload

logger = logging.getLogger(__name__)

MAGIC = b"PDKV"
VERSION = 1
_FIXED = struct.Struct(f"<4sH{HASH_NBYTES}s{HASH_NBYTES}sIQQ")  # magic, version, hash, parent, n tokens, size, sum
_HEADER_SUM = struct.Struct("<Q")
SUFFIX = ".blk"
TMP_PREFIX = ".tmp-"


def encode_header(key: BlockKey, payload_nbytes: int, checksum: int) -> bytes:
    fixed = _FIXED.pack(MAGIC, VERSION, key.block_hash, key.parent_hash, len(key.token_ids), payload_nbytes, checksum)
    body = fixed + np.asarray(key.token_ids, dtype="<i4").tobytes()
    return body + _HEADER_SUM.pack(xxhash.xxh3_64_intdigest(body))


def decode_header(head: bytes) -> tuple[BlockKey, int, int, int]:
    """(key, payload size, payload checksum, header size); ValueError when it does not verify."""
    if len(head) < _FIXED.size:
        raise ValueError("truncated header")
    magic, version, block_hash, parent, num_tokens, nbytes, checksum = _FIXED.unpack_from(head)
    if magic != MAGIC or version != VERSION:
        raise ValueError(f"not a pdmesh block file (magic {magic!r}, version {version})")
    body_end = _FIXED.size + 4 * num_tokens
    if len(head) < body_end + _HEADER_SUM.size:
        raise ValueError("truncated header")
    (header_sum,) = _HEADER_SUM.unpack_from(head, body_end)
    if xxhash.xxh3_64_intdigest(head[:body_end]) != header_sum:
        raise ValueError("header checksum mismatch")
    token_ids = tuple(int(t) for t in np.frombuffer(head[_FIXED.size:body_end], dtype="<i4"))
    return BlockKey(block_hash, parent, token_ids), nbytes, checksum, body_end + _HEADER_SUM.size


class DiskTier:
    name = "nvme"

    def __init__(self, directory: str | Path, capacity_bytes: int, block_nbytes: int, fsync: bool = True) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.capacity_blocks = capacity_bytes // block_nbytes
        self._block_nbytes = block_nbytes
        self._fsync = fsync
        self._num_used = 0

    @property
    def num_free(self) -> int:
        return self.capacity_blocks - self._num_used

    def path_of(self, block_hash: bytes) -> Path:
        return self.directory / f"{block_hash.hex()}{SUFFIX}"

    def write(self, key: BlockKey, payload: Payload, checksum: int) -> Path:
        final = self.path_of(key.block_hash)
        tmp = self.directory / f"{TMP_PREFIX}{final.name}"
        with open(tmp, "wb") as file:
            file.write(encode_header(key, len(payload), checksum))
            file.write(payload)
            if self._fsync:
                file.flush()
                os.fsync(file.fileno())
        os.replace(tmp, final)
        self._sync_directory()
        self._num_used += 1
        return final

    def read(self, handle: Path) -> memoryview:
        with open(handle, "rb") as file:
            data = bytearray(os.fstat(file.fileno()).st_size)  # writable: it lands in torch tensors
            file.readinto(data)
        _, nbytes, _, header_nbytes = decode_header(data)
        payload = memoryview(data)[header_nbytes:]
        if payload.nbytes != nbytes:
            raise ValueError(f"{handle.name}: payload {payload.nbytes} bytes, header says {nbytes}")
        return payload

    def free(self, handle: Path) -> None:
        handle.unlink(missing_ok=True)
        self._num_used -= 1

    def recovered(self) -> Iterator[tuple[BlockKey, Path, int]]:
        """Verified headers of the blocks left by an earlier run, oldest first; deletes the rest."""
        for tmp in self.directory.glob(f"{TMP_PREFIX}*"):
            tmp.unlink(missing_ok=True)
        files = sorted(self.directory.glob(f"*{SUFFIX}"), key=lambda p: p.stat().st_mtime_ns)
        for path in files:
            found = self._recover(path)
            if found is None:
                path.unlink(missing_ok=True)
                continue
            if self._num_used >= self.capacity_blocks:
                path.unlink(missing_ok=True)
                continue
            self._num_used += 1
            yield found

    def _recover(self, path: Path) -> tuple[BlockKey, Path, int] | None:
        try:
            with open(path, "rb") as file:
                head = file.read(_FIXED.size + 4 * 65536 + _HEADER_SUM.size)
            key, nbytes, checksum, _ = decode_header(head)
        except (OSError, ValueError) as exc:
            logger.warning("dropping unreadable block file %s: %s", path.name, exc)
            return None
        if nbytes != self._block_nbytes or path.name != f"{key.block_hash.hex()}{SUFFIX}":
            logger.warning("dropping block file %s: size %d or name does not match", path.name, nbytes)
            return None
        return key, path, checksum

    def _sync_directory(self) -> None:
        if not self._fsync:
            return
        fd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

"""NVMe tier: a log-structured slab. One preallocated file of equal slots holds the payloads; an
append-only journal says what each slot holds.

    slab.bin     capacity_blocks slots of block_nbytes: payloads only
    journal.log  records: place(slot, block header) once the slot's payload is durable; free(slot)
    tier.lock    held (flock) for the tier's life: one tier per directory

The directory is 0700 and its files 0600, whatever the umask (kvstore/tier_dir.py says which
directories are tightened and which refused).

A batch of n blocks costs one vectored write per run of consecutive slots, one fdatasync of the
slab, one append of n place records and one fdatasync of the journal (the commit record) — not
a file, an fsync and a directory fsync per block. A crash before the journal's fdatasync leaves
the batch's slots free. A slot is handed out again only after its free record was appended, and
the journal is append-only, so its next place record can never be replayed before that free; a
block whose bytes were overwritten while its free record did not reach the disk fails its
checksum when read, like any corrupt block. At start the journal is replayed up to its first torn
record and rewritten with just the live blocks; it is rewritten again whenever it grows to
twice the live records.

A full disk (ENOSPC) loses cached blocks, never the tier: an append the disk had no room for is
cut off again (a torn record would hide every later one at the next start), a rewrite with no room
for its copy is skipped (at start the journal is kept as it is, cut after its last whole record),
and a free record that does not fit is left out (see `free`).
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import re
import struct
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash

from kvstore.block_key import BlockKey
from kvstore.tier import FreeSlots, check_rows, contiguous_runs
from kvstore.tier_dir import check_own_files, lock_directory, make_private_dir, open_private, remove_own_files, unlock
from pdmesh.kv.block_hash import HASH_NBYTES

logger = logging.getLogger(__name__)

MAGIC = b"PDKV"
# 3: SHA-256 block names; 4: blocks' checksums over their pieces (pdmesh/kv/checksum.py). An older
# journal's blocks are dropped at start, never served.
VERSION = 4
_FIXED = struct.Struct(f"<4sH{HASH_NBYTES}s{HASH_NBYTES}sIQQ")  # magic, version, hash, parent, n tokens, size, sum
_HEADER_SUM = struct.Struct("<Q")
_RECORD = struct.Struct("<4sBII")  # magic, kind, slot, body size; then the body and its record's xxh3-64
_RECORD_MAGIC = b"PDKJ"
_PLACE, _FREE = 1, 2
SLAB_NAME = "slab.bin"
JOURNAL_NAME = "journal.log"
TMP_JOURNAL_NAME = f".tmp-{JOURNAL_NAME}"   # a rewrite's copy, until its rename
_V1_BLOCK = re.compile(rf"(?P<copy>\.tmp-)?[0-9a-f]{{{2 * HASH_NBYTES}}}\.blk")  # v1's file per block, its copy
_COMPACT_MIN_BYTES = 1 << 20


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
        raise ValueError(f"not a pdmesh block header (magic {magic!r}, version {version})")
    body_end = _FIXED.size + 4 * num_tokens
    if len(head) < body_end + _HEADER_SUM.size:
        raise ValueError("truncated header")
    (header_sum,) = _HEADER_SUM.unpack_from(head, body_end)
    if xxhash.xxh3_64_intdigest(head[:body_end]) != header_sum:
        raise ValueError("header checksum mismatch")
    token_ids = tuple(int(t) for t in np.frombuffer(head[_FIXED.size:body_end], dtype="<i4"))
    return BlockKey(block_hash, parent, token_ids), nbytes, checksum, body_end + _HEADER_SUM.size


def _record(kind: int, slot: int, body: bytes = b"") -> bytes:
    head = _RECORD.pack(_RECORD_MAGIC, kind, slot, len(body)) + body
    return head + _HEADER_SUM.pack(xxhash.xxh3_64_intdigest(head))


@dataclass(frozen=True)
class JournalEntry:
    key: BlockKey
    checksum: int
    record: bytes  # its place record, as written (to rewrite the journal)


def replay_journal(path: Path, block_nbytes: int, capacity_blocks: int) -> dict[int, JournalEntry]:
    """slot -> what it holds, oldest placement first, from the journal's records up to the first
    torn or foreign one. A key placed twice keeps its later slot."""
    return _replay(path, block_nbytes, capacity_blocks)[0]


def _replay(path: Path, block_nbytes: int, capacity_blocks: int) -> tuple[dict[int, JournalEntry], int]:
    """replay_journal's slots, and the bytes of the journal's whole records (where the torn tail begins)."""
    data = path.read_bytes() if path.exists() else b""
    slots: dict[int, JournalEntry] = {}
    position = 0
    while position < len(data):
        parsed = _parse_record(data, position)
        if parsed is None:
            logger.warning("%s: torn or foreign record at byte %d of %d: ignoring the rest", path, position, len(data))
            break
        kind, slot, body, position = parsed
        slots.pop(slot, None)
        if kind == _PLACE and slot < capacity_blocks:
            key, nbytes, checksum, _ = decode_header(body)
            if nbytes == block_nbytes:
                slots[slot] = JournalEntry(key, checksum, data[position - len(body) - _RECORD.size - 8:position])
    slot_of: dict[bytes, int] = {}
    for slot, entry in list(slots.items()):
        older = slot_of.get(entry.key.block_hash)
        if older is not None:
            del slots[older]
        slot_of[entry.key.block_hash] = slot
    return slots, position


def _parse_record(data: bytes, position: int) -> tuple[int, int, bytes, int] | None:
    if position + _RECORD.size > len(data):
        return None
    magic, kind, slot, body_nbytes = _RECORD.unpack_from(data, position)
    end = position + _RECORD.size + body_nbytes
    if magic != _RECORD_MAGIC or kind not in (_PLACE, _FREE) or end + _HEADER_SUM.size > len(data):
        return None
    (record_sum,) = _HEADER_SUM.unpack_from(data, end)
    if xxhash.xxh3_64_intdigest(data[position:end]) != record_sum:
        return None
    body = data[position + _RECORD.size:end]
    if kind == _PLACE:
        try:
            decode_header(body)
        except ValueError:
            return None
    return kind, slot, body, end + _HEADER_SUM.size


def find_block(directory: str | Path, block_hash: bytes, block_nbytes: int) -> tuple[Path, int] | None:
    """(slab file, byte offset) of a block's payload on disk, from the journal (operators, tests)."""
    directory = Path(directory)
    for slot, entry in replay_journal(directory / JOURNAL_NAME, block_nbytes, 1 << 62).items():
        if entry.key.block_hash == block_hash:
            return directory / SLAB_NAME, slot * block_nbytes
    return None


class DiskTier:
    name = "nvme"
    slow = True

    def __init__(self, directory: str | Path, capacity_bytes: int, block_nbytes: int, fsync: bool = True) -> None:
        self.directory = Path(directory)
        make_private_dir(self.directory)
        self._lock_fd = lock_directory(self.directory)
        self._slab_fd = self._journal_fd = -1
        self._direct: _DirectWriter | None = None
        try:
            self._open(capacity_bytes, block_nbytes, fsync)
        except BaseException:
            self.close()
            raise

    def _open(self, capacity_bytes: int, block_nbytes: int, fsync: bool) -> None:
        self.capacity_blocks = capacity_bytes // block_nbytes
        self._block_nbytes = block_nbytes
        self._fsync = fsync
        self.num_journal_errors = 0   # records and rewrites the disk had no room for
        self._journal_path = self.directory / JOURNAL_NAME
        self._journal_lock = threading.Lock()
        check_own_files(self.directory, (SLAB_NAME, JOURNAL_NAME, TMP_JOURNAL_NAME))
        self._remove_debris()
        self._live, whole_nbytes = _replay(self._journal_path, block_nbytes, self.capacity_blocks)
        self._live_nbytes = sum(len(entry.record) for entry in self._live.values())  # kept as records come and go
        self._recovered = list(self._live.items())
        self._slab_fd = open_private(self.directory / SLAB_NAME, os.O_RDWR | os.O_CREAT)
        os.ftruncate(self._slab_fd, self.capacity_blocks * block_nbytes)
        self._direct = _DirectWriter.open(self.directory / SLAB_NAME, block_nbytes)
        self._failed_rewrite_nbytes = 0   # the journal's size when a rewrite last found no room
        self._open_journal(whole_nbytes)
        self._free_slots = FreeSlots("nvme", self.capacity_blocks, self._live)

    @property
    def num_free(self) -> int:
        return len(self._free_slots)

    @property
    def writes_direct(self) -> bool:
        return self._direct is not None

    def allocate(self, num_blocks: int) -> list[int]:
        return self._free_slots.take(num_blocks)

    def write_many(self, handles: Sequence[int], keys: Sequence[BlockKey], rows: np.ndarray,
                   checksums: Sequence[int]) -> None:
        check_rows("nvme", rows, len(handles), self._block_nbytes)
        for start, slot, count in contiguous_runs(handles):
            run, offset = rows[start:start + count], slot * self._block_nbytes
            if self._direct is not None:
                self._direct.write(run, offset)
            else:
                _pwrite_all(self._slab_fd, memoryview(run).cast("B"), offset)
        if self._fsync:
            os.fdatasync(self._slab_fd)
        records = {slot: _record(_PLACE, slot, encode_header(key, self._block_nbytes, checksum))
                   for slot, key, checksum in zip(handles, keys, checksums)}
        with self._journal_lock:
            self._append(b"".join(records.values()))
            if self._fsync:
                os.fdatasync(self._journal_fd)
            for (slot, record), key, checksum in zip(records.items(), keys, checksums):
                self._live[slot] = JournalEntry(key, checksum, record)
                self._live_nbytes += len(record)
            self._compact_if_grown()

    def read_many(self, handles: Sequence[int], out: np.ndarray) -> None:
        for start, slot, count in contiguous_runs(handles):
            nbytes = os.preadv(self._slab_fd, [out[start:start + count]], slot * self._block_nbytes)
            if nbytes != count * self._block_nbytes:
                raise ValueError(f"nvme: short read of slots {slot}..{slot + count - 1} ({nbytes} bytes)")

    def free(self, handle: int) -> None:
        """Never fails: a free record the disk has no room for (ENOSPC) is left out. A restart may then
        recover the freed block from the slot: its old bytes, or a later block's whose place record
        was not written either, which fails its checksum on read and is dropped."""
        with self._journal_lock:
            freed = self._live.pop(handle, None)
            self._live_nbytes -= len(freed.record) if freed else 0
            try:
                self._append(_record(_FREE, handle))  # durable with the next commit
            except OSError as exc:
                self.num_journal_errors += 1
                logger.warning("nvme: free record of slot %d not written: %s", handle, exc)
        self._free_slots.give_back(handle)

    def recovered(self) -> Iterator[tuple[BlockKey, int, int]]:
        """Blocks the journal says survived an earlier run, oldest placement first (once)."""
        recovered, self._recovered = self._recovered, []
        for slot, entry in recovered:
            yield entry.key, slot, entry.checksum

    def close(self) -> None:
        for fd in (self._slab_fd, self._journal_fd):
            if fd >= 0:
                os.close(fd)
        self._slab_fd = self._journal_fd = -1
        if self._direct is not None:
            self._direct.close()
            self._direct = None
        if self._lock_fd >= 0:
            unlock(self._lock_fd)
            self._lock_fd = -1

    # ---- journal upkeep ----
    def _append(self, records: bytes) -> None:
        """Appends whole records, or none: what a full disk took only part of is cut off again."""
        nbytes_before = os.fstat(self._journal_fd).st_size
        try:
            _write_all(self._journal_fd, records)
        except OSError:
            with contextlib.suppress(OSError):
                os.ftruncate(self._journal_fd, nbytes_before)
            raise

    def _open_journal(self, whole_nbytes: int) -> None:
        """At start: the journal rewritten with the live blocks only; where the disk has no room for
        that copy, the journal as it is, cut after its last whole record (a cut needs no room)."""
        try:
            self._rewrite_journal()
        except OSError as exc:
            self.num_journal_errors += 1
            logger.warning("nvme: journal not rewritten at start (%s); appending to it as it is", exc)
            self._journal_fd = open_private(self._journal_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
            os.ftruncate(self._journal_fd, whole_nbytes)

    def _compact_if_grown(self) -> None:
        nbytes = os.fstat(self._journal_fd).st_size
        if nbytes <= max(2 * self._live_nbytes, self._failed_rewrite_nbytes) + _COMPACT_MIN_BYTES:
            return
        try:
            self._rewrite_journal()
            self._failed_rewrite_nbytes = 0
        except OSError as exc:  # no room for the copy: tried again once the journal grew some more
            self._failed_rewrite_nbytes = nbytes
            self.num_journal_errors += 1
            logger.warning("nvme: journal not rewritten (%s); still appending to it", exc)

    def _rewrite_journal(self) -> None:
        """Replaces the journal by the live blocks' place records (tmp, fsync, rename, dir fsync);
        a copy the disk had no room for is removed again."""
        tmp = self.directory / TMP_JOURNAL_NAME
        try:
            with os.fdopen(open_private(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), "wb") as file:
                file.write(b"".join(entry.record for entry in self._live.values()))
                if self._fsync:
                    file.flush()
                    os.fsync(file.fileno())
        except OSError:
            tmp.unlink(missing_ok=True)
            raise
        os.replace(tmp, self._journal_path)
        self._sync_directory()
        if self._journal_fd >= 0:
            os.close(self._journal_fd)
        self._journal_fd = open_private(self._journal_path, os.O_WRONLY | os.O_APPEND)

    def _remove_debris(self) -> None:
        """Removes a crashed rewrite's copy and v1's files, and nothing else the directory holds."""
        removed = remove_own_files(self.directory, _is_debris)
        if removed:
            logger.info("nvme: removed %d files a crashed or older tier left in %s", len(removed), self.directory)

    def _sync_directory(self) -> None:
        if not self._fsync:
            return
        fd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class _DirectWriter:
    """Writes slab runs with O_DIRECT (the page cache would only add a copy and a writeback the
    fdatasync then waits for), through a page-aligned bounce buffer. Only where slots are whole
    pages and the file system takes O_DIRECT; otherwise the tier writes through the page cache.
    Reads stay buffered (the kernel keeps the two coherent)."""

    PAGE = 4096
    BOUNCE_NBYTES = 8 << 20

    def __init__(self, fd: int, block_nbytes: int) -> None:
        self._fd = fd
        self._bounce = mmap.mmap(-1, max(self.BOUNCE_NBYTES, block_nbytes))  # page-aligned
        self._blocks_per_write = len(self._bounce) // block_nbytes
        self._lock = threading.Lock()  # one bounce buffer; the store may flush two batches at once

    @classmethod
    def open(cls, path: Path, block_nbytes: int) -> _DirectWriter | None:
        if block_nbytes % cls.PAGE or not hasattr(os, "O_DIRECT"):
            return None
        try:
            fd = os.open(path, os.O_WRONLY | os.O_DIRECT | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:  # tmpfs and some others refuse O_DIRECT
            return None
        return cls(fd, block_nbytes)

    def write(self, run: np.ndarray, offset: int) -> None:
        with self._lock:
            self._write_locked(run, offset)

    def _write_locked(self, run: np.ndarray, offset: int) -> None:
        for start in range(0, len(run), self._blocks_per_write):
            part = run[start:start + self._blocks_per_write]
            view = memoryview(self._bounce)[:part.nbytes]
            np.copyto(np.frombuffer(view, dtype=np.uint8).reshape(part.shape), part)
            _pwrite_all(self._fd, view, offset + start * part.shape[1])

    def close(self) -> None:
        os.close(self._fd)
        self._bounce.close()


def _is_debris(path: Path) -> bool:
    """A file the tier made and no longer uses (asked only of this user's regular files): the
    rewrite's copy, v1's copies, and v1's block files (their header's magic says so)."""
    if path.name == TMP_JOURNAL_NAME:
        return True
    v1_file = _V1_BLOCK.fullmatch(path.name)
    if v1_file is None or v1_file["copy"]:
        return v1_file is not None
    with open(path, "rb") as file:
        return file.read(len(MAGIC)) == MAGIC


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        written = os.pwrite(fd, data, offset)
        data, offset = data[written:], offset + written


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]

"""What the registered-memory transports (shm, Mooncake) share: open the transfer on the control
path (the producer's block ids, checksums and content hashes), refuse blocks holding other tokens
before moving anything, move the rest in batches of merged block runs into the local KV cache
(shm straight from the producer's memory, Mooncake through a staging slab), and verify each landed
block's checksum where it landed."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import replace

import numpy as np

from decode.kv.kv_port_client import KVPortClient
from pdmesh.errors import BlockHashMismatch, ChecksumMismatch, WorkerFailed
from pdmesh.kv.checksum import combine, piece_digest
from pdmesh.kv.kv_layout import (Copy, LayerRegion, copy_plan, digest_matrix, first_difference, piece_columns,
                                 piece_index)
from pdmesh.transport.kv_transport import PeerLink, ReadOptions

BATCH_NBYTES = 16 << 20  # moved, then verified, at a time: a failure keeps the batches before it
CHUNK_NBYTES = 256 << 10  # copied, then hashed while in cache (measured: 1 MiB chunks fall out of L2)


class RegisteredMemoryReader:
    transport = ""

    def __init__(self, control: KVPortClient, local_regions: Sequence[LayerRegion],
                 local_views: Sequence[np.ndarray]) -> None:
        self._control = control
        self._local = tuple(local_regions)
        self._local_views = local_views  # the local cache in host memory, a flat uint8 view per layer

    def read_blocks(self, link: PeerLink, transfer_id: str, block_indexes: Sequence[int],
                    local_block_ids: Sequence[int], expected_hashes: Sequence[bytes],
                    options: ReadOptions = ReadOptions()) -> Iterator[int]:
        answer = self._control.open_soon(link.address, transfer_id, block_indexes, self.transport)
        expected = [expected_hashes[index] for index in block_indexes]  # (computed while the Open travels)
        opened = answer()
        if options.stall_s:
            time.sleep(options.stall_s)
        if len(opened.block_ids) != len(block_indexes) or len(opened.checksums) != len(block_indexes):
            raise WorkerFailed(f"transfer {transfer_id}: opened {len(opened.block_ids)} of {len(block_indexes)} blocks")
        num_good = first_difference(opened.block_hashes, expected)
        num_good = len(block_indexes) if num_good is None else num_good
        per_batch = max(1, BATCH_NBYTES // self._control.block_nbytes)
        batches = [(start, min(start + per_batch, num_good)) for start in range(0, num_good, per_batch)]
        plans = [copy_plan(link.regions, self._local, opened.block_ids[start:end], list(local_block_ids[start:end]))
                 for start, end in batches]
        started = self._start(link, plans[0]) if plans else None
        for number, (start, end) in enumerate(batches):
            following = self._start(link, plans[number + 1]) if number + 1 < len(plans) else None  # in flight meanwhile
            digests = self.digest_matrix(end - start) if options.verify else None
            try:
                self._finish(link, started, digests, options)
            except BaseException:
                self._abandon(following)
                raise
            bad = first_difference(combine(digests), opened.checksums[start:end]) if digests is not None else None
            if bad is not None:
                self._abandon(following)
                if bad:
                    yield start + bad
                raise ChecksumMismatch(f"block {block_indexes[start + bad]}: checksum of the landed bytes differs "
                                       f"from the producer's")
            yield end
            started = following
        if num_good < len(block_indexes):
            raise BlockHashMismatch(f"block {block_indexes[num_good]} holds other tokens than the request's")

    def land_layers(self, link: PeerLink, transfer_id: str, block_indexes: Sequence[int], src_ids: Sequence[int],
                    dst_ids: Sequence[int], layers: range, digests: np.ndarray | None,
                    options: ReadOptions = ReadOptions()) -> None:
        """Moves `layers` of the transfer's blocks at block_indexes (the producer's blocks src_ids)
        into local blocks dst_ids, now, filling those layers' columns of `digests` (a row per block;
        None: not verifying). The layer-wise flow's step (decode/kv/layerwise_read.py). At most
        BATCH_NBYTES a batch (one block's layers when larger), as read_blocks moves: a Mooncake
        batch lands in a staging slab of that size; the next batch is in flight while one is copied out."""
        batches = self._layer_batches(link, src_ids, dst_ids, layers)
        started = self._start(link, batches[0]) if batches else None
        for number in range(len(batches)):
            following = self._start(link, batches[number + 1]) if number + 1 < len(batches) else None
            try:
                self._finish(link, started, digests, options)
            except BaseException:
                self._abandon(following)
                raise
            started = following

    def _layer_batches(self, link: PeerLink, src_ids: Sequence[int], dst_ids: Sequence[int],
                       layers: range) -> list[list[Copy]]:
        """The copies moving `layers` of the blocks, in batches of at most BATCH_NBYTES (whole blocks)."""
        nbytes_per_block = sum(self._local[layer].block_nbytes for layer in layers)
        per_batch = max(1, BATCH_NBYTES // max(1, nbytes_per_block))
        batches = []
        for start in range(0, len(src_ids), per_batch):
            end = min(start + per_batch, len(src_ids))
            copies = [replace(copy, layer=layer, first=copy.first + start)
                      for layer in layers
                      for copy in copy_plan([link.regions[layer]], [self._local[layer]], src_ids[start:end],
                                            dst_ids[start:end])]
            if copies:
                batches.append(copies)
        return batches

    def piece_columns(self, layers: range) -> list[int]:
        return piece_columns([region.num_parts for region in self._local], layers)

    def _start(self, link: PeerLink, copies: list[Copy]):
        """Starts moving a batch (a transport that can move one batch while the previous one is
        copied out starts it here); what it returns goes to _finish or _abandon."""
        return copies

    def _finish(self, link: PeerLink, started, digests: np.ndarray | None, options: ReadOptions) -> None:
        """Lands a started batch, filling `digests` (a row per block of the batch, a column per
        piece) with the landed pieces' hashes (None: not verifying)."""
        self._land(link, started, digests, options)

    def _abandon(self, started) -> None:
        """A started batch whose read is given up (an earlier one failed)."""
        return None

    def _land(self, link: PeerLink, copies: list[Copy], digests: np.ndarray | None, options: ReadOptions) -> None:
        """Moves a batch, filling `digests` as _finish does."""
        raise NotImplementedError

    def digest_matrix(self, num_blocks: int) -> np.ndarray:
        return digest_matrix([region.num_parts for region in self._local], num_blocks)

    def _copy_out(self, copies: Sequence[Copy], sources: Sequence[tuple[memoryview, int]],
                  digests: np.ndarray | None, options: ReadOptions) -> None:
        """Copies each copy's bytes from its source (a view, and the offset of its first byte there)
        into the local cache, hashing each piece right after copying it, while it is still in cache
        (a second pass over memory would cost about as much as the copy), into `digests` (row:
        the copy's `first` and the blocks after it; None when not verifying)."""
        starts = piece_index(self._local)
        digest = piece_digest
        for copy, (src, src_offset) in zip(copies, sources):  # memoryview slices: numpy's cost as much as a hash
            piece = self._local[copy.layer].part_nbytes
            chunk = max(1, CHUNK_NBYTES // piece) * piece
            dst = memoryview(self._local_views[copy.layer])
            column = (digests[copy.first:copy.first + copy.nbytes // piece, starts[copy.layer] + copy.part]
                      if digests is not None else None)
            for offset in range(0, copy.nbytes, chunk):
                end = min(copy.nbytes, offset + chunk)
                dst[copy.dst + offset:copy.dst + end] = src[src_offset + offset:src_offset + end]
                if options.tamper is not None and offset == 0 and copy.first == 0:
                    options.tamper(dst[copy.dst:copy.dst + piece])
                if digests is not None:
                    column[offset // piece:end // piece] = [digest(dst[at:at + piece])
                                                            for at in range(copy.dst + offset, copy.dst + end, piece)]

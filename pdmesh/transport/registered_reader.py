"""What the registered-memory transports (shm, Mooncake) share: open the transfer on the control
path (the producer's block ids, checksums and content hashes), refuse blocks holding other tokens
before moving anything, move the rest in batches of merged block runs into the local KV cache
(shm straight from the producer's memory, Mooncake through a staging slab), and verify each landed
block's checksum where it landed."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

import numpy as np
import xxhash

from pdmesh.errors import BlockHashMismatch, ChecksumMismatch, WorkerFailed
from pdmesh.transport.grpc_kv_receiver import GrpcKVReceiver
from pdmesh.transport.kv_layout import Copy, LayerRegion, combine, copy_plan, piece_index
from pdmesh.transport.kv_transport import PeerLink, ReadOptions

BATCH_NBYTES = 16 << 20  # moved, then verified, at a time: a failure keeps the batches before it
CHUNK_NBYTES = 256 << 10  # copied, then hashed while in cache (measured: 1 MiB chunks fall out of L2)


class RegisteredMemoryReader:
    transport = ""

    def __init__(self, control: GrpcKVReceiver, local_regions: Sequence[LayerRegion],
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
        num_good = next((i for i, (sent, want) in enumerate(zip(opened.block_hashes, expected)) if sent != want),
                        len(block_indexes))
        per_batch = max(1, BATCH_NBYTES // self._control.block_nbytes)
        batches = [(start, min(start + per_batch, num_good)) for start in range(0, num_good, per_batch)]
        plans = [copy_plan(link.regions, self._local, opened.block_ids[start:end], list(local_block_ids[start:end]))
                 for start, end in batches]
        started = self._start(link, plans[0]) if plans else None
        for number, (start, end) in enumerate(batches):
            following = self._start(link, plans[number + 1]) if number + 1 < len(plans) else None  # in flight meanwhile
            try:
                landed = self._finish(link, started, list(local_block_ids[start:end]), options)
            except BaseException:
                self._abandon(following)
                raise
            bad = (next((i for i, (got, sent) in enumerate(zip(landed, opened.checksums[start:end])) if got != sent),
                        None) if landed is not None else None)
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

    def _start(self, link: PeerLink, copies: list[Copy]):
        """Starts moving a batch (a transport that can move one batch while the previous one is
        copied out starts it here); what it returns goes to _finish or _abandon."""
        return copies

    def _finish(self, link: PeerLink, started, local_block_ids: list[int], options: ReadOptions) -> list[int] | None:
        return self._land(link, started, local_block_ids, options)

    def _abandon(self, started) -> None:
        """A started batch whose read is given up (an earlier one failed)."""
        return None

    def _land(self, link: PeerLink, copies: list[Copy], local_block_ids: list[int],
              options: ReadOptions) -> list[int] | None:
        """Moves a batch; returns the checksums of the bytes that landed (None: not verifying)."""
        raise NotImplementedError

    def _copy_out(self, copies: Sequence[Copy], sources: Sequence[tuple[memoryview, int]], num_blocks: int,
                  options: ReadOptions) -> list[int] | None:
        """Copies each copy's bytes from its source (a view, and the offset of its first byte there)
        into the local cache, hashing each piece right after copying it, while it is still in cache
        (a second pass over memory would cost about as much as the copy). Returns the landed
        blocks' checksums (None when not verifying)."""
        starts = piece_index(self._local)
        digests = np.empty((num_blocks, starts[-1] + self._local[-1].num_parts), dtype=np.uint64)
        digest = xxhash.xxh3_64_intdigest
        for copy, (src, src_offset) in zip(copies, sources):  # memoryview slices: numpy's cost as much as a hash
            piece = self._local[copy.layer].part_nbytes
            chunk = max(1, CHUNK_NBYTES // piece) * piece
            dst = memoryview(self._local_views[copy.layer])
            column = digests[copy.first:copy.first + copy.nbytes // piece, starts[copy.layer] + copy.part]
            for offset in range(0, copy.nbytes, chunk):
                end = min(copy.nbytes, offset + chunk)
                dst[copy.dst + offset:copy.dst + end] = src[src_offset + offset:src_offset + end]
                if options.tamper is not None and offset == 0 and copy.first == 0:
                    options.tamper(dst[copy.dst:copy.dst + piece])
                if options.verify:
                    column[offset // piece:end // piece] = [digest(dst[at:at + piece])
                                                            for at in range(copy.dst + offset, copy.dst + end, piece)]
        return combine(digests) if options.verify else None

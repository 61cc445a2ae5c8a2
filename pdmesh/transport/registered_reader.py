"""What the registered-memory transports (shm, Mooncake) share: open the transfer on the control
path (the producer's block ids, checksums and content hashes), refuse blocks holding other tokens
before moving anything, move the rest in batches of merged block runs straight into the local KV
cache, and verify each landed block's checksum where it landed."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import numpy as np

from pdmesh.errors import BlockHashMismatch, ChecksumMismatch, WorkerFailed
from pdmesh.transport.grpc_kv_receiver import GrpcKVReceiver
from pdmesh.transport.kv_layout import Copy, LayerRegion, copy_plan
from pdmesh.transport.kv_transport import PeerLink, ReadOptions

BATCH_BLOCKS = 64  # blocks moved, then verified, at a time: a failure keeps the batches before it


class RegisteredMemoryReader:
    transport = ""

    def __init__(self, control: GrpcKVReceiver, local_regions: Sequence[LayerRegion],
                 local_checksums: Callable[[list[int]], list[int]],
                 local_views: Sequence[np.ndarray] | None = None) -> None:
        self._control = control
        self._local = tuple(local_regions)
        self._local_checksums = local_checksums
        self._local_views = local_views  # host memory only: what a tamper hook alters

    def read_blocks(self, link: PeerLink, transfer_id: str, block_indexes: Sequence[int],
                    local_block_ids: Sequence[int], expected_hashes: Sequence[bytes],
                    options: ReadOptions = ReadOptions()) -> Iterator[int]:
        opened = self._control.open(link.address, transfer_id, block_indexes, self.transport)
        if len(opened.block_ids) != len(block_indexes) or len(opened.checksums) != len(block_indexes):
            raise WorkerFailed(f"transfer {transfer_id}: opened {len(opened.block_ids)} of {len(block_indexes)} blocks")
        num_good = next((i for i, index in enumerate(block_indexes)
                         if opened.block_hashes[i] != expected_hashes[index]), len(block_indexes))
        for start in range(0, num_good, BATCH_BLOCKS):
            end = min(start + BATCH_BLOCKS, num_good)
            local = list(local_block_ids[start:end])
            self._move(link, copy_plan(link.regions, self._local, opened.block_ids[start:end], local))
            if options.tamper is not None:
                self._tamper(local[0], options.tamper)
            bad = self._first_bad(local, opened.checksums[start:end]) if options.verify else None
            if bad is not None:
                if bad:
                    yield start + bad
                raise ChecksumMismatch(f"block {block_indexes[start + bad]}: checksum of the landed bytes differs "
                                       f"from the producer's")
            yield end
        if num_good < len(block_indexes):
            raise BlockHashMismatch(f"block {block_indexes[num_good]} holds other tokens than the request's")

    def _move(self, link: PeerLink, copies: list[Copy]) -> None:
        raise NotImplementedError

    def _first_bad(self, local_block_ids: list[int], checksums: Sequence[int]) -> int | None:
        landed = self._local_checksums(local_block_ids)
        return next((i for i, (got, sent) in enumerate(zip(landed, checksums)) if got != sent), None)

    def _tamper(self, local_block_id: int, tamper) -> None:
        if self._local_views is None:
            raise WorkerFailed("this cache cannot be altered in place")
        for view, region in zip(self._local_views, self._local):
            for part in range(region.num_parts):
                start = region.offset(local_block_id, part)
                tamper(view[start:start + region.part_nbytes])

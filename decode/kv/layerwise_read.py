"""Consumer side of the layer-wise flow: decode has reserved its blocks before the prompt is
prefilled, and reads each layer of each block as soon as the producer reports it written
(KVTransfer.Watch), while prefill computes the next layers; once prefill is done and the blocks
are held, it reads what is left, then verifies every block like a whole read does (content hash
of its tokens, checksum of the landed bytes against the producer's), so the equivalence and
wrong-KV guarantees of the pull flow hold unchanged.

The consumer moves the bytes (it reads from the producer's memory, shared or registered), so no
write can land in its cache after it gave a reservation up: a stalled producer cannot corrupt
blocks vLLM has handed to another request (kvcache-ai/Mooncake#4247: a transfer cannot be
cancelled). Over gRPC the producer streams the layers asked for (KVTransfer.Pull with a layer
range).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from decode.kv.kv_port_client import KVPortClient
from pdmesh.errors import BlockHashMismatch, ChecksumMismatch, WorkerFailed
from pdmesh.kv.checksum import combine
from pdmesh.kv.kv_layout import first_difference
from pdmesh.transport.kv_transport import KVReader, PeerLink, ReadOptions
from pdmesh.v1 import kv_transfer_pb2

WATCH_WAIT_S = 1.0  # one Watch waits this long for progress


@dataclass
class LayerwiseTiming:
    """What one layer-wise read did, for telemetry: reading time before the producer's last layer
    was written (hidden behind its compute) and from then until every block was in and verified."""

    seconds_before_prefill_done: float = 0.0
    seconds_after_prefill_done: float = 0.0
    num_layer_reads: int = 0   # reads of newly written layers (one per group of blocks and layers)

    @property
    def overlap_ratio(self) -> float:
        total = self.seconds_before_prefill_done + self.seconds_after_prefill_done
        return self.seconds_before_prefill_done / total if total > 0 else 0.0


@dataclass(frozen=True)
class LayerwiseTarget:
    block_size: int
    num_tokens: int        # the prompt tokens the producer computes (the last block may be partial)
    num_layers: int
    idle_timeout_s: float  # no progress for this long: the producer is gone or stuck


def read_layerwise(reader: KVReader, control: KVPortClient, link: PeerLink, transfer_id: str,
                   block_indexes: Sequence[int], local_block_ids: Sequence[int], expected_hashes: Sequence[bytes],
                   target: LayerwiseTarget, timing: LayerwiseTiming,
                   options: ReadOptions = ReadOptions()) -> Iterator[int]:
    """read_blocks' contract, for a transfer still being prefilled (the reader moves the layers:
    land_layers)."""
    yield from _LayerwiseRead(reader, control, link, transfer_id, block_indexes, local_block_ids, target, timing,
                              options).run(expected_hashes)


class _LayerwiseRead:
    def __init__(self, reader, control: KVPortClient, link: PeerLink, transfer_id: str,
                 block_indexes: Sequence[int], local_block_ids: Sequence[int], target: LayerwiseTarget,
                 timing: LayerwiseTiming, options: ReadOptions) -> None:
        self._reader, self._control, self._link, self._transfer_id = reader, control, link, transfer_id
        self._indexes, self._local_ids = list(block_indexes), list(local_block_ids)
        self._target, self._timing, self._options = target, timing, options
        count = len(self._indexes)
        self._num_landed = [0] * count           # layers landed, per position (they land in order)
        self._read_from = [-1] * count           # the producer block each position was read from
        self._digests = reader.digest_matrix(count) if options.verify else None
        self._prefill_done_at: float | None = None
        self._num_restarts = 0

    def run(self, expected_hashes: Sequence[bytes]) -> Iterator[int]:
        answer, version, progress = None, 0, None
        idle_until = time.monotonic() + self._target.idle_timeout_s
        while answer is None or not answer.held:
            answer = self._control.watch(self._link.address, self._transfer_id, version, WATCH_WAIT_S,
                                         self._indexes, self._reader.transport)
            version = answer.version
            # a step's start is progress though not announced (no new version): its tokens show it
            if (version, answer.num_partial_tokens, answer.restarts) != progress:
                progress = (version, answer.num_partial_tokens, answer.restarts)
                idle_until = time.monotonic() + self._target.idle_timeout_s
            elif time.monotonic() > idle_until:
                raise WorkerFailed(f"transfer {self._transfer_id}: no prefill progress for "
                                   f"{self._target.idle_timeout_s:.0f} s")
            if answer.held or (answer.started and answer.num_ready_tokens >= self._target.num_tokens):
                self._mark_prefill_done()
            if not answer.held:
                self._land_ready(answer)
        held_ids = list(answer.block_ids)
        if len(answer.checksums) != len(self._indexes) or any(index >= len(held_ids) for index in self._indexes):
            raise WorkerFailed(f"transfer {self._transfer_id}: held {len(held_ids)} blocks, "
                               f"{len(answer.checksums)} checksums for {len(self._indexes)}")
        self._land_rest([held_ids[index] for index in self._indexes])
        yield from self._verify(answer, [expected_hashes[index] for index in self._indexes])
        self._timing.seconds_after_prefill_done = time.perf_counter() - self._prefill_done_at

    def _mark_prefill_done(self) -> None:
        if self._prefill_done_at is None:
            self._prefill_done_at = time.perf_counter()

    def _available_layers(self, answer: kv_transfer_pb2.WatchResponse, index: int) -> int:
        """Layers of the producer's block `index` in its cache now."""
        if index >= len(answer.block_ids):
            return 0
        end = min((index + 1) * self._target.block_size, self._target.num_tokens)
        if end <= answer.num_ready_tokens:
            return self._target.num_layers
        return answer.num_partial_layers if end <= answer.num_partial_tokens else 0

    def _land_ready(self, answer: kv_transfer_pb2.WatchResponse) -> None:
        if answer.restarts != self._num_restarts:  # preempted: its blocks were freed, read them again
            self._num_restarts = answer.restarts
            self._num_landed = [0] * len(self._indexes)
        producer_ids = [answer.block_ids[index] if index < len(answer.block_ids) else -1 for index in self._indexes]
        self._land_available(producer_ids, [self._available_layers(answer, index) for index in self._indexes])

    def _land_rest(self, producer_ids: list[int]) -> None:
        """Prefill is done: every layer of every block is in the producer's cache."""
        self._land_available(producer_ids, [self._target.num_layers] * len(self._indexes))

    def _land_available(self, producer_ids: list[int], available: list[int]) -> None:
        """Lands, per position, the layers of producer block producer_ids[position] from the first not
        landed up to available[position]; one read per group of positions with the same layers."""
        wanted: dict[tuple[int, int], list[int]] = {}
        for position, (producer_id, num_available) in enumerate(zip(producer_ids, available)):
            if num_available and self._read_from[position] not in (-1, producer_id):
                self._num_landed[position] = 0  # moved to another block (a restart we did not see)
            if num_available > self._num_landed[position]:
                wanted.setdefault((self._num_landed[position], num_available), []).append(position)
        for (first_layer, end_layer), positions in wanted.items():
            self._land(positions, [producer_ids[p] for p in positions], range(first_layer, end_layer))

    def _land(self, positions: list[int], producer_ids: list[int], layers: range) -> None:
        started = time.perf_counter()
        digests = self._reader.digest_matrix(len(positions)) if self._digests is not None else None
        self._reader.land_layers(self._link, self._transfer_id, [self._indexes[p] for p in positions], producer_ids,
                                 [self._local_ids[p] for p in positions], layers, digests, self._options)
        if digests is not None:
            columns = self._reader.piece_columns(layers)
            self._digests[np.ix_(positions, columns)] = digests[:, columns]
        for position, producer_id in zip(positions, producer_ids):
            self._num_landed[position] = layers.stop
            self._read_from[position] = producer_id
        self._timing.num_layer_reads += 1
        if self._options.stall_s and self._timing.num_layer_reads == 1:
            time.sleep(self._options.stall_s)  # fault tests: a peer is killed in the middle of the read
        if self._prefill_done_at is None:
            self._timing.seconds_before_prefill_done += time.perf_counter() - started

    def _verify(self, opened: kv_transfer_pb2.WatchResponse, expected: list[bytes]) -> Iterator[int]:
        count = len(self._indexes)
        num_good = first_difference(opened.block_hashes, expected)
        num_good = count if num_good is None else num_good
        if self._digests is not None:
            bad = first_difference(combine(self._digests[:num_good]), opened.checksums)
            if bad is not None:
                if bad:
                    yield bad
                raise ChecksumMismatch(f"block {self._indexes[bad]}: checksum of the landed bytes differs "
                                       f"from the producer's")
        if num_good:
            yield num_good
        if num_good < count:
            raise BlockHashMismatch(f"block {self._indexes[num_good]} holds other tokens than the request's")

"""Producer side of the layer-wise flow: how far each transfer still being prefilled has been
computed, layer by layer, for consumers that read each layer as soon as it is in the cache.

The engine thread reports progress (a step starts; a layer's KV is written; the step's forward
is done) with a few integer updates under a lock; consumers long-poll it through the KV port's
Watch (gRPC threads), answered on a change a consumer acts on (not a step's start: its first
written layers are the next answer) or at the end of their wait.
Tokens [0, ready) have every layer; tokens [ready, partial) (the step being computed) have their
first `layers` layers. Each answer costs the producer's process a gRPC round trip while it
computes, so a step's written layers are announced once they hold `min_read_bytes` (or the step is
done): layer by layer only where one layer of the step's KV is that large. Once the step
completing the prompt is done, its content hashes and checksums are published (`written`): a
consumer can finish reading and verifying then, a step before the engine holds the transfer (its
blocks are the running request's until then, and an early release is applied at the hold). Once
held (prefill/kv/held_transfers.py) the transfer leaves this registry.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from pdmesh.errors import InvalidRequest, TransferNotFound
from pdmesh.v1 import kv_transfer_pb2
from prefill.kv.held_transfers import HeldTransfer, HeldTransfers


@dataclass(eq=False)  # compared by identity (the running step's list)
class _Progress:
    request_id: str
    block_ids: list[int] = field(default_factory=list)
    num_ready_tokens: int = 0
    num_partial_tokens: int = 0
    num_partial_layers: int = 0
    restarts: int = 0
    version: int = 1
    written: HeldTransfer | None = None  # the whole prompt is in the cache: what its hold will be
    num_announced_layers: int = 0  # of the running step's layers


class LayerProgress:
    def __init__(self, num_layers: int, held: HeldTransfers, ended_ttl_s: float = 300.0,
                 layer_bytes_per_token: int = 0, min_read_bytes: int = 0) -> None:
        self._num_layers = num_layers
        self._layer_bytes_per_token = layer_bytes_per_token  # one layer's KV of one token
        self._min_read_bytes = min_read_bytes
        self._held = held
        self._cond = threading.Condition()
        self._progress: dict[str, _Progress] = {}   # transfer id: its progress while prefilling
        self._in_step: list[_Progress] = []         # those the running step computes
        self._ended: dict[str, float] = {}          # transfer id: forget after this monotonic time
        self._ended_ttl_s = ended_ttl_s

    # ---- the engine thread ----
    def start_step(self, transfer_id: str, request_id: str, block_ids: list[int], num_tokens_before: int,
                   num_tokens_after: int) -> None:
        """A step computes tokens [num_tokens_before, num_tokens_after) of the transfer's prompt.
        Not announced: a consumer has nothing new to read until the step's first layers are written
        (its next answer carries the step's blocks)."""
        with self._cond:
            if transfer_id in self._ended:
                return
            progress = self._progress.setdefault(transfer_id, _Progress(request_id))
            progress.block_ids = list(block_ids)
            progress.num_ready_tokens = num_tokens_before
            progress.num_partial_tokens = num_tokens_after
            progress.num_partial_layers = progress.num_announced_layers = 0
            self._in_step.append(progress)

    def restart(self, transfer_id: str) -> None:
        """The engine preempted the request: its blocks were freed (and may hold other KV now)."""
        with self._cond:
            progress = self._progress.get(transfer_id)
            if progress is None:
                return
            progress.block_ids, progress.num_ready_tokens, progress.num_partial_tokens = [], 0, 0
            progress.num_partial_layers = 0
            progress.written = None
            progress.restarts += 1
            progress.version += 1
            if progress in self._in_step:
                self._in_step.remove(progress)
            self._cond.notify_all()

    def layer_done(self, layer_index: int) -> None:
        """The step's KV of layer `layer_index` is in the cache (vLLM's save_kv_layer)."""
        if not self._in_step:  # no layer-wise transfer in this step: nothing to take
            return
        with self._cond:
            announced = False
            for progress in self._in_step:
                progress.num_partial_layers = layer_index + 1
                step_tokens = progress.num_partial_tokens - progress.num_ready_tokens
                if progress.num_partial_layers - progress.num_announced_layers >= self._layers_per_answer(step_tokens):
                    progress.num_announced_layers = progress.num_partial_layers
                    progress.version += 1
                    announced = True
            if announced:
                self._cond.notify_all()

    def step_done(self) -> None:
        """The step's forward is done: every layer of its tokens is in the cache."""
        if not self._in_step:
            return
        with self._cond:
            for progress in self._in_step:
                progress.num_ready_tokens = progress.num_partial_tokens
                progress.num_partial_layers = self._num_layers
                progress.version += 1
            self._in_step = []
            self._cond.notify_all()

    def _layers_per_answer(self, num_tokens: int) -> int:
        step_layer_bytes = num_tokens * self._layer_bytes_per_token
        if not self._min_read_bytes or not step_layer_bytes:
            return 1
        return -(-self._min_read_bytes // step_layer_bytes)  # more than num_layers: the step's end only

    def restarts(self, transfer_id: str) -> int:
        """Times the transfer's request was preempted so far (-1: not prefilling)."""
        with self._cond:
            progress = self._progress.get(transfer_id)
            return progress.restarts if progress is not None else -1

    def written(self, transfer_id: str, transfer: HeldTransfer, restarts: int) -> None:
        """Every layer of the prompt is in the cache, and `transfer` is what its hold will be (content
        hashes, checksums): published unless the request was preempted or ended since `restarts` was read."""
        with self._cond:
            progress = self._progress.get(transfer_id)
            if progress is None or progress.restarts != restarts:
                return
            progress.written = transfer
            progress.version += 1
            self._cond.notify_all()

    def held(self, transfer_id: str) -> None:
        """Prefill is done and the transfer is held (call after HeldTransfers.hold): Watch answers from there."""
        self._end(transfer_id)

    def end(self, transfer_id: str) -> None:
        """The transfer will not be held (its prefill was aborted or failed): watchers get NOT_FOUND."""
        self._end(transfer_id)

    def end_request(self, request_id: str) -> None:
        with self._cond:
            ids = [tid for tid, progress in self._progress.items() if progress.request_id == request_id]
        for transfer_id in ids:
            self._end(transfer_id)

    def _end(self, transfer_id: str) -> None:
        now = time.monotonic()
        with self._cond:
            progress = self._progress.pop(transfer_id, None)
            if progress is not None and progress in self._in_step:
                self._in_step.remove(progress)
            for old in [tid for tid, until in self._ended.items() if until <= now]:
                del self._ended[old]
            self._ended[transfer_id] = now + self._ended_ttl_s
            self._cond.notify_all()

    @property
    def num_prefilling(self) -> int:
        with self._cond:
            return len(self._progress)

    # ---- gRPC threads ----
    def watch(self, transfer_id: str, seen_version: int, wait_s: float) -> kv_transfer_pb2.WatchResponse:
        """The transfer's progress once its version passes seen_version (or after wait_s, as it is)."""
        return self.watch_written(transfer_id, seen_version, wait_s)[0]

    def watch_written(self, transfer_id: str, seen_version: int,
                      wait_s: float) -> tuple[kv_transfer_pb2.WatchResponse, HeldTransfer | None]:
        """watch(), and the written transfer that answer is final with (None: not written, or held)."""
        deadline = time.monotonic() + wait_s
        with self._cond:
            while True:
                answer = self._answer(transfer_id)
                left = deadline - time.monotonic()
                if answer.version > seen_version or answer.held or left <= 0:
                    progress = self._progress.get(transfer_id)
                    return answer, progress.written if progress is not None else None
                self._cond.wait(left)

    def written_transfer(self, transfer_id: str) -> HeldTransfer | None:
        """The transfer as its hold will be, if its prompt is written and it is not held yet."""
        with self._cond:
            progress = self._progress.get(transfer_id)
            return progress.written if progress is not None else None

    def block_ids(self, transfer_id: str, block_indexes: list[int]) -> list[int]:
        """The producer's blocks at those positions of a transfer being prefilled or held (what a
        layer read may read: only that transfer's blocks)."""
        with self._cond:
            progress = self._progress.get(transfer_id)
            held = self._held.get(transfer_id) if progress is None else None
            if progress is None and held is None:
                raise TransferNotFound(f"no KV held or being prefilled for transfer {transfer_id!r}")
            every = progress.block_ids if progress is not None else held.block_ids
        bad = [i for i in block_indexes if not 0 <= i < len(every)]
        if bad:
            raise InvalidRequest(f"transfer {transfer_id}: block indexes {bad} outside [0, {len(every)})")
        return [every[i] for i in block_indexes]

    def _answer(self, transfer_id: str) -> kv_transfer_pb2.WatchResponse:
        progress = self._progress.get(transfer_id)
        if progress is not None and progress.written is not None:  # final, like a held one
            return kv_transfer_pb2.WatchResponse(version=progress.version, started=True,
                                                 block_ids=progress.written.block_ids, held=True,
                                                 restarts=progress.restarts)
        if progress is not None:
            return kv_transfer_pb2.WatchResponse(
                version=progress.version, started=True, block_ids=progress.block_ids,
                num_ready_tokens=progress.num_ready_tokens, num_partial_tokens=progress.num_partial_tokens,
                num_partial_layers=progress.num_partial_layers, restarts=progress.restarts)
        held = self._held.get(transfer_id)  # held before it left this registry: no gap between the two
        if held is not None:
            return kv_transfer_pb2.WatchResponse(version=1 << 62, started=True, block_ids=held.block_ids, held=True)
        if transfer_id in self._ended:
            raise TransferNotFound(f"transfer {transfer_id!r} was released or abandoned")
        return kv_transfer_pb2.WatchResponse(version=0)  # not scheduled by the engine yet

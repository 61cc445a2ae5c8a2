"""Producer-side registry of KV transfers whose blocks are pinned until the consumer releases them."""

from __future__ import annotations

import threading
import time
from collections import Counter
from concurrent.futures import Future
from dataclasses import dataclass, field

from pdmesh.errors import TransferNotFound


@dataclass(frozen=True)
class HeldTransfer:
    transfer_id: str
    block_ids: tuple[int, ...]
    block_hashes: tuple[bytes, ...]
    deadline: float  # time.monotonic() after which the blocks are freed without a release
    request_id: str = ""  # the pdmesh request it belongs to
    engine_request_id: str = ""  # the engine's id of the request (what vLLM frees the blocks by); "": transfer_id
    # The blocks' checksums for the registered-memory transports, computed off the engine thread as
    # soon as the blocks are held (an Open waits for them instead of reading the blocks itself).
    checksums: Future | None = field(default=None, compare=False)


class HeldTransfers:
    """Thread-safe: the engine thread registers and collects, gRPC threads wait and release.

    The engine registers a transfer one step after the request finished, so a consumer that
    needs nothing (a full local prefix hit) can release it before it is held: such an early
    release is remembered until `early_release_ttl_s` and applied when the hold arrives. A read of a
    transfer that has ended (released, cancelled, expired) fails at once, for as long: a consumer
    late past the deadline must not wait out the hold's registration for blocks already freed.
    A read waits for the hold only of a transfer id the engine announced (`announce`: minted when
    its request was first scheduled, so before the id can leave the engine); any other id is
    answered at once, so reads of made-up ids hold no KV-port thread.
    """

    def __init__(self, early_release_ttl_s: float = 300.0, announced_ttl_s: float = 3600.0) -> None:
        self._cond = threading.Condition()
        self._held: dict[str, HeldTransfer] = {}
        self._finished: set[str] = set()
        self._engine_ids: dict[str, str] = {}  # transfer id: engine request id, until reported finished
        self._leases: Counter[str] = Counter()  # transfer id: local readers (the KV store's save)
        self._released_early: dict[str, float] = {}  # transfer id: forget after this monotonic time
        self._cancelled_early: dict[str, float] = {}  # pdmesh request id: forget after this monotonic time
        self._ended: dict[str, tuple[str, float]] = {}  # transfer id: (how it ended, forget after this time)
        self._announced: dict[str, float] = {}  # transfer id to be held: forget after this monotonic time
        self._early_release_ttl_s = early_release_ttl_s
        self._announced_ttl_s = announced_ttl_s  # a safety net: a hold or `drop_announced` forgets it first
        self._num_expired = 0

    def announce(self, transfer_ids: list[str], now: float | None = None) -> None:
        """Transfers the engine will hold when their requests finish: a read may wait for their holds."""
        until = (time.monotonic() if now is None else now) + self._announced_ttl_s
        with self._cond:
            for transfer_id in transfer_ids:
                self._announced[transfer_id] = until

    def drop_announced(self, transfer_ids: list[str]) -> None:
        """Announced transfers that will never be held (their requests ended without handing KV over)."""
        with self._cond:
            for transfer_id in transfer_ids:
                if self._announced.pop(transfer_id, None) is not None:
                    self._end(transfer_id, "abandoned")

    def hold(self, transfer: HeldTransfer) -> None:
        with self._cond:
            self._announced.pop(transfer.transfer_id, None)
            self._engine_ids[transfer.transfer_id] = transfer.engine_request_id or transfer.transfer_id
            early = self._released_early.pop(transfer.transfer_id, None)
            if early is not None or self._cancelled_early.pop(transfer.request_id, None) is not None:
                self._finished.add(transfer.transfer_id)
                self._end(transfer.transfer_id, "released")
                return
            self._held[transfer.transfer_id] = transfer
            self._cond.notify_all()

    def wait_for(self, transfer_id: str, timeout_s: float) -> HeldTransfer:
        """The transfer, waiting for the engine to register it (it may lag the response by a step);
        an id neither held, ended nor announced fails at once."""
        with self._cond:
            if not (transfer_id in self._held or transfer_id in self._ended or transfer_id in self._announced):
                raise TransferNotFound(f"no KV held for transfer {transfer_id!r}, and none announced")
            found = self._cond.wait_for(lambda: transfer_id in self._held or transfer_id in self._ended,
                                        timeout=timeout_s)
            if transfer_id in self._ended:
                raise TransferNotFound(f"KV of transfer {transfer_id!r} was {self._ended[transfer_id][0]} "
                                       f"before this read")
            if not found:
                raise TransferNotFound(f"no KV held for transfer {transfer_id!r}")
            return self._held[transfer_id]

    def get(self, transfer_id: str) -> HeldTransfer | None:
        """The transfer if it is held now (no waiting)."""
        with self._cond:
            return self._held.get(transfer_id)

    def release(self, transfer_id: str) -> bool:
        """True when it freed a held transfer; False when it was not held (yet, or any more)."""
        with self._cond:
            if self._held.pop(transfer_id, None) is None:
                if transfer_id not in self._finished:
                    self._released_early[transfer_id] = time.monotonic() + self._early_release_ttl_s
                return False
            self._finished.add(transfer_id)
            self._end(transfer_id, "released")
            return True

    def release_request(self, request_id: str) -> int:
        """Frees what a cancelled request holds: its transfers, or the one the engine registers next
        (remembered until early_release_ttl_s). The number freed now."""
        with self._cond:
            ids = [tid for tid, held in self._held.items() if held.request_id == request_id]
            for transfer_id in ids:
                del self._held[transfer_id]
                self._finished.add(transfer_id)
                self._end(transfer_id, "cancelled")
            if not ids and request_id:
                self._cancelled_early[request_id] = time.monotonic() + self._early_release_ttl_s
            return len(ids)

    def lease(self, transfer_id: str) -> None:
        """A local reader of the blocks: they are not freed, released or expired, until unleased."""
        with self._cond:
            self._leases[transfer_id] += 1

    def unlease(self, transfer_id: str) -> None:
        with self._cond:
            self._leases[transfer_id] -= 1
            if self._leases[transfer_id] <= 0:
                del self._leases[transfer_id]

    def take_finished(self, now: float | None = None) -> set[str]:
        """Engine request ids of the transfers released since the last call, plus those past their
        deadline, that no lease holds."""
        now = time.monotonic() if now is None else now
        with self._cond:
            expired = [tid for tid, held in self._held.items() if held.deadline <= now and tid not in self._leases]
            for transfer_id in expired:
                del self._held[transfer_id]
                self._end(transfer_id, "expired", now)
            for remembered in (self._released_early, self._cancelled_early, self._announced):
                for key in [key for key, until in remembered.items() if until <= now]:
                    del remembered[key]
            for transfer_id in [tid for tid, (_, until) in self._ended.items() if until <= now]:
                del self._ended[transfer_id]
            self._num_expired += len(expired)
            self._finished |= set(expired)
            finished = {tid for tid in self._finished if tid not in self._leases}
            self._finished -= finished
            return {self._engine_ids.pop(tid, tid) for tid in finished}

    def _end(self, transfer_id: str, how: str, now: float | None = None) -> None:
        """Remembers how a transfer ended (under the lock), waking reads waiting for it."""
        now = time.monotonic() if now is None else now
        self._ended[transfer_id] = (how, now + self._early_release_ttl_s)
        self._cond.notify_all()

    @property
    def num_held(self) -> int:
        """Transfers whose blocks are still pinned: held for a consumer, or leased by a local reader."""
        with self._cond:
            return len(self._held.keys() | self._leases.keys())

    @property
    def num_expired(self) -> int:
        with self._cond:
            return self._num_expired

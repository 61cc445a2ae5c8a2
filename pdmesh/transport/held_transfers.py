"""Producer-side registry of KV transfers whose blocks are pinned until the consumer releases them."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from pdmesh.errors import TransferNotFound


@dataclass(frozen=True)
class HeldTransfer:
    transfer_id: str
    block_ids: tuple[int, ...]
    block_hashes: tuple[bytes, ...]
    deadline: float  # time.monotonic() after which the blocks are freed without a release


class HeldTransfers:
    """Thread-safe: the engine thread registers and collects, gRPC threads wait and release."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._held: dict[str, HeldTransfer] = {}
        self._finished: set[str] = set()
        self._num_expired = 0

    def hold(self, transfer: HeldTransfer) -> None:
        with self._cond:
            self._held[transfer.transfer_id] = transfer
            self._cond.notify_all()

    def wait_for(self, transfer_id: str, timeout_s: float) -> HeldTransfer:
        """The transfer, waiting for the engine to register it (it may lag the response by a step)."""
        with self._cond:
            found = self._cond.wait_for(lambda: transfer_id in self._held, timeout=timeout_s)
            if not found:
                raise TransferNotFound(f"no KV held for transfer {transfer_id!r}")
            return self._held[transfer_id]

    def release(self, transfer_id: str) -> bool:
        with self._cond:
            if self._held.pop(transfer_id, None) is None:
                return False
            self._finished.add(transfer_id)
            return True

    def take_finished(self, now: float | None = None) -> set[str]:
        """Ids released since the last call, plus those past their deadline."""
        now = time.monotonic() if now is None else now
        with self._cond:
            expired = [tid for tid, held in self._held.items() if held.deadline <= now]
            for transfer_id in expired:
                del self._held[transfer_id]
            self._num_expired += len(expired)
            finished, self._finished = self._finished | set(expired), set()
            return finished

    @property
    def num_held(self) -> int:
        with self._cond:
            return len(self._held)

    @property
    def num_expired(self) -> int:
        with self._cond:
            return self._num_expired

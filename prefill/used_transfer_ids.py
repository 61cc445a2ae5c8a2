"""The layer-wise transfer ids a prefill worker has published KV under. The gateway mints one per
attempt; a second request with one it already used (a replay) would publish its KV under a
transfer another request holds, and the first request's blocks would never be freed: refused."""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Callable

from pdmesh.errors import InvalidRequest

# Longer than the engine holds a transfer or remembers how one ended (hold_timeout_s, 60 s by
# default, plus HeldTransfers' 300 s): after that a reused id finds nothing of the first request.
REMEMBER_S = 3600.0


class UsedTransferIds:
    def __init__(self, remember_s: float = REMEMBER_S, clock: Callable[[], float] = time.monotonic) -> None:
        self._forget_at: OrderedDict[str, float] = OrderedDict()   # transfer id: when to forget it, oldest first
        self._remember_s = remember_s
        self._clock = clock

    def claim(self, transfer_id: str) -> None:
        """Records a request's transfer id ("": none), or raises InvalidRequest if it was used before."""
        if not transfer_id:
            return
        now = self._clock()
        while self._forget_at and next(iter(self._forget_at.values())) <= now:
            self._forget_at.popitem(last=False)
        if transfer_id in self._forget_at:
            raise InvalidRequest(f"layerwise_transfer_id {transfer_id!r} was already used on this worker: "
                                 f"each attempt needs a freshly minted one")
        self._forget_at[transfer_id] = now + self._remember_s

    def __len__(self) -> int:
        return len(self._forget_at)

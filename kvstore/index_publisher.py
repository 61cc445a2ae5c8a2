"""The store's changes sent to its index from a thread of their own. The store tells its listener
on the thread that changed it: a KV port thread exporting blocks to a peer, a load, a save. With the
index in Redis, each of those waited a Redis round trip; when Redis was slow (starved of CPU beside
spinning engines, it took 1 s over an HSET), exports held their peers' loads and the mesh stalled
(py-spy: KV port threads in `RedisBlockIndex.on_events` under `Export`). The index is a cache of
where blocks are (a stale entry is a miss its reader recovers from), so it may trail the store by
a moment: changes are queued in order and sent in batches; past `max_backlog` events the oldest
are dropped (counted), as the index would have lost them to a Redis outage anyway."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

from kvstore.store_events import StoreEvent, StoreListener

logger = logging.getLogger(__name__)

MAX_BATCH = 512   # events per call to the index (one pipelined round trip)


class BackgroundPublisher:
    """A StoreListener that hands events to `index` on its own thread, in order."""

    def __init__(self, index: StoreListener, max_backlog: int = 65536) -> None:
        self._index = index
        self._queue: deque[StoreEvent] = deque()
        self._max_backlog = max_backlog
        self._cond = threading.Condition()
        self._num_sending = 0
        self._closed = False
        self.num_dropped = 0   # events not sent: the backlog overflowed
        self._thread = threading.Thread(target=self._run, name="pdmesh-kv-index", daemon=True)
        self._thread.start()

    def on_events(self, events: list[StoreEvent]) -> None:
        with self._cond:
            if self._closed:
                return
            self._queue.extend(events)
            overflow = len(self._queue) - self._max_backlog
            for _ in range(max(0, overflow)):
                self._queue.popleft()
            if overflow > 0:
                self.num_dropped += overflow
            self._cond.notify()

    @property
    def num_pending(self) -> int:
        """Events queued or being sent."""
        with self._cond:
            return len(self._queue) + self._num_sending

    def flush(self, timeout_s: float) -> bool:
        """Waits until every event queued so far was sent (or failed); False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._queue or self._num_sending:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout_s: float = 2.0) -> None:
        """Sends what is queued (for at most timeout_s), then stops the thread."""
        self.flush(timeout_s)
        with self._cond:
            self._closed = True
            self._queue.clear()
            self._cond.notify_all()
        self._thread.join(timeout=timeout_s)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                batch = [self._queue.popleft() for _ in range(min(MAX_BATCH, len(self._queue)))]
                self._num_sending = len(batch)
            try:
                self._index.on_events(batch)
            except Exception:  # noqa: BLE001 - the index is a cache; the store stays the truth
                logger.warning("store index update failed", exc_info=True)
            with self._cond:
                self._num_sending = 0
                self._cond.notify_all()

"""The store's changes sent to its index from a thread of their own. The store tells its listener
on the thread that changed it: a KV port thread exporting blocks to a peer, a load, a save. With the
index in Redis, each of those waited a Redis round trip; when Redis was slow (starved of CPU beside
spinning engines, it took 1 s over an HSET), exports held their peers' loads and the mesh stalled
(py-spy: KV port threads in `RedisBlockIndex.on_events` under `Export`). The index is a cache of
where blocks are (a stale entry is a miss its reader recovers from), so it may trail the store by
a moment: changes are queued in order and sent in batches; past `max_backlog` events the oldest
are dropped (counted), as the index would have lost them to a Redis outage anyway. Events are
numbered as they are queued: `wait_sent(n)` waits for the first n (a save waits for its own entries;
later traffic does not extend the wait)."""

from __future__ import annotations

import logging
import threading
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
        self._num_queued = 0   # events ever queued (their numbers)
        self._num_done = 0     # events ever sent, failed or dropped (the first num_done of them)
        self._closed = False
        self.num_dropped = 0   # events not sent: the backlog overflowed
        self._thread = threading.Thread(target=self._run, name="pdmesh-kv-index", daemon=True)
        self._thread.start()

    def on_events(self, events: list[StoreEvent]) -> None:
        with self._cond:
            if self._closed:
                return
            self._queue.extend(events)
            self._num_queued += len(events)
            overflow = len(self._queue) - self._max_backlog
            for _ in range(max(0, overflow)):
                self._queue.popleft()
            if overflow > 0:
                self.num_dropped += overflow
                self._num_done += overflow
            self._cond.notify_all()

    @property
    def num_queued(self) -> int:
        """How many events were ever queued: the number of the latest."""
        with self._cond:
            return self._num_queued

    @property
    def num_pending(self) -> int:
        """Events queued or being sent."""
        with self._cond:
            return self._num_queued - self._num_done

    def wait_sent(self, num_events: int, timeout_s: float) -> bool:
        """Waits until the first `num_events` events ever queued were sent (or failed, or were
        dropped); False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self._num_done >= num_events or self._closed, timeout=timeout_s)

    def flush(self, timeout_s: float) -> bool:
        """Waits until every event queued before the call was sent; False on timeout."""
        return self.wait_sent(self.num_queued, timeout_s)

    def close(self, timeout_s: float = 2.0) -> None:
        """Sends what is queued (for at most timeout_s), then stops the thread."""
        self.flush(timeout_s)
        with self._cond:
            self._closed = True
            self._num_done += len(self._queue)
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
            try:
                self._index.on_events(batch)
            except Exception:  # noqa: BLE001 - the index is a cache; the store stays the truth
                logger.warning("store index update failed", exc_info=True)
            with self._cond:
                self._num_done += len(batch)
                self._cond.notify_all()

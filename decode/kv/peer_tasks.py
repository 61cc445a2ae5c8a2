"""A consumer's transfer threads, shared by the producers it reads from: at most `per_peer` tasks of
one producer run at once, and the others wait their turn in that producer's queue, holding no
thread. A producer that stops answering (each read of it waits out its timeout, 30 s by default)
then holds `per_peer` threads, not every one: reads from the other producers go on."""

from __future__ import annotations

import functools
import logging
import threading
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

logger = logging.getLogger(__name__)


class PerPeerExecutor:
    def __init__(self, max_workers: int, per_peer: int, thread_name_prefix: str,
                 initializer: Callable[[], object] | None = None) -> None:
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=thread_name_prefix,
                                        initializer=initializer)
        self._per_peer = per_peer
        self._lock = threading.Lock()
        self._running: Counter[str] = Counter()                    # peer: its tasks running now
        self._waiting: dict[str, deque[Callable[[], None]]] = {}  # peer: its tasks waiting for a turn

    def submit(self, peer: str, fn: Callable[..., None], *args) -> None:
        task = functools.partial(fn, *args)
        with self._lock:
            if self._running[peer] >= self._per_peer:
                self._waiting.setdefault(peer, deque()).append(task)
                return
            self._running[peer] += 1
        self._pool.submit(self._run, peer, task)

    def _run(self, peer: str, task: Callable[[], None] | None) -> None:
        """Runs the task, then the peer's waiting ones in turn (on this thread)."""
        while task is not None:
            try:
                task()
            except Exception:  # noqa: BLE001 - one task's failure must not stop the peer's others
                logger.exception("KV transfer task for %s failed", peer)
            task = self._next(peer)

    def _next(self, peer: str) -> Callable[[], None] | None:
        with self._lock:
            waiting = self._waiting.get(peer)
            if waiting:
                return waiting.popleft()
            self._waiting.pop(peer, None)
            self._running[peer] -= 1
            if self._running[peer] <= 0:
                del self._running[peer]
            return None

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        """wait: until the running tasks, and the waiting ones unless cancel_futures, are done."""
        if cancel_futures:
            with self._lock:
                self._waiting.clear()
        self._pool.shutdown(wait=wait, cancel_futures=cancel_futures)

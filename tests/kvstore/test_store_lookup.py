"""AsyncStoreLookup: the scheduler's store lookups never make a request wait more than max_wait_s,
however many queue behind a store that does not answer (fake clock, a store that blocks)."""

from __future__ import annotations

import threading

from kvstore.store_lookup import AsyncStoreLookup

MAX_WAIT_S = 1.0


class BlockingStore:
    """A StoreLookup whose answers wait for `release`; counts the lookups that ran."""

    def __init__(self, nodes: list[str]) -> None:
        self.nodes = nodes
        self.release = threading.Event()
        self.num_started = 0
        self._lock = threading.Lock()

    def nodes_of_cached_prefix(self, prompt_token_ids, block_hashes) -> list[str]:
        with self._lock:
            self.num_started += 1
        self.release.wait(timeout=30)
        return self.nodes

    def close(self) -> None:
        pass


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_burst_behind_a_silent_store_waits_max_wait_each_not_its_place_in_the_queue():
    """Before: 2 threads, each lookup up to its 1 s deadline: the 14th request of a burst waited 7 s."""
    store, clock = BlockingStore(["", ""]), Clock()
    lookups = AsyncStoreLookup(store, max_workers=2, max_wait_s=MAX_WAIT_S, clock=clock)
    try:
        request_ids = [f"r{i}" for i in range(14)]
        assert [lookups.poll(r, [1] * 100, []) for r in request_ids] == [None] * 14
        clock.now += MAX_WAIT_S - 0.01
        assert [lookups.poll(r, [1] * 100, []) for r in request_ids] == [None] * 14
        clock.now += 0.02
        assert [lookups.poll(r, [1] * 100, []) for r in request_ids] == [[]] * 14   # misses: computed
        assert (lookups.num_given_up, lookups.num_pending) == (14, 0)
        assert store.num_started <= 2   # the queued lookups were cancelled, not run
    finally:
        store.release.set()
        lookups.close()


def test_an_answer_in_time_is_used_and_the_next_request_asks_afresh():
    store, clock = BlockingStore(["", "10.0.0.2:7"]), Clock()
    store.release.set()
    lookups = AsyncStoreLookup(store, max_workers=2, max_wait_s=MAX_WAIT_S, clock=clock)
    try:
        assert lookups.poll("r1", [1] * 100, []) is None
        while lookups.poll("r1", [1] * 100, []) is None:   # answered on the pool's thread
            pass
        assert lookups.num_given_up == 0 and lookups.num_pending == 0
        assert lookups.poll("r1", [1] * 100, []) is None   # a new lookup for a request seen again
    finally:
        lookups.close()


def test_the_wait_counts_from_when_the_lookup_was_asked_for():
    store, clock = BlockingStore([""]), Clock()
    lookups = AsyncStoreLookup(store, max_workers=1, max_wait_s=MAX_WAIT_S, clock=clock)
    try:
        assert lookups.poll("early", [1] * 40, []) is None
        clock.now += 0.6
        assert lookups.poll("late", [1] * 40, []) is None
        clock.now += 0.6
        assert (lookups.poll("early", [1] * 40, []), lookups.poll("late", [1] * 40, [])) == ([], None)
    finally:
        store.release.set()
        lookups.close()

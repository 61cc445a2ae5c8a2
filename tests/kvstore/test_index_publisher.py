"""BackgroundPublisher: the store never waits for its index. Against a real Redis that stops
answering (SIGSTOP: a Redis starved of CPU, as in the soak) and with a listener that blocks."""

from __future__ import annotations

import os
import signal
import threading
import time

from kvstore.block_store import TieredBlockStore
from kvstore.index_publisher import BackgroundPublisher
from kvstore.redis_index import IndexEntry, RedisBlockIndex
from kvstore.slab_tier import host_tier
from kvstore.store_events import BlockDropped, BlockPlaced
from tests.kvstore.factories import BLOCK_NBYTES, keys, payload

NODE = "10.0.0.1:7000"


class BlockingIndex:
    """Records the events it is given once `release` is set."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.entered = threading.Event()   # the publisher's thread is in a call
        self.events: list = []

    def on_events(self, events) -> None:
        self.entered.set()
        self.release.wait(timeout=30)
        self.events += events


def _store(listener) -> TieredBlockStore:
    return TieredBlockStore([host_tier(2 * BLOCK_NBYTES, BLOCK_NBYTES)], BLOCK_NBYTES, listener=listener)


def test_a_store_change_returns_while_redis_does_not_answer_and_the_index_catches_up(redis_server):
    """Before: the store told RedisBlockIndex on the changing thread: every put and read (a peer's
    export) waited Redis's 0.5 s timeout, then the entry was lost."""
    index = RedisBlockIndex.connect(redis_server.url, "s3cret", namespace="fp-test", node=NODE, ttl_s=60)
    publisher = BackgroundPublisher(index)
    store, k = _store(publisher), keys(2)
    pid = redis_server._process.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        started = time.perf_counter()
        _store(index).put(keys(1, first_token=500)[0], payload(9))   # the control: told on this thread
        assert time.perf_counter() - started >= 0.4   # Redis's 0.5 s timeout
        started = time.perf_counter()
        store.put(k[0], payload(0))
        store.put(k[1], payload(1))
        store.read_prefix(k)
        assert time.perf_counter() - started < 0.2
        assert publisher.num_pending > 0
    finally:
        os.kill(pid, signal.SIGCONT)
    # the batch sent while Redis was stopped may have timed out (lost, counted); the next change is sent
    store.put(k[1], payload(1))
    assert publisher.flush(timeout_s=5)
    assert index.probe([k[1].block_hash])[0] == IndexEntry(NODE, "dram")
    publisher.close()
    index.close()


def test_events_reach_the_index_in_order_after_a_blocked_call():
    index = BlockingIndex()
    publisher = BackgroundPublisher(index)
    store, k = _store(publisher), keys(3)
    for i, key in enumerate(k):   # the third evicts the first
        store.put(key, payload(i))
    assert publisher.num_pending == 4 and not publisher.flush(timeout_s=0.05)   # 3 placed, 1 dropped
    index.release.set()
    assert publisher.flush(timeout_s=5) and publisher.num_pending == 0
    placed = [e.block_hash for e in index.events if isinstance(e, BlockPlaced)]
    assert placed == [key.block_hash for key in k]
    assert [e.block_hash for e in index.events if isinstance(e, BlockDropped)] == [k[0].block_hash]
    assert index.events.index(next(e for e in index.events if isinstance(e, BlockDropped))) > 1
    publisher.close()


def test_past_its_backlog_the_oldest_events_are_dropped_and_counted():
    index = BlockingIndex()
    publisher = BackgroundPublisher(index, max_backlog=2)
    store = _store(publisher)
    store.put(keys(1)[0], payload(0))
    assert index.entered.wait(timeout=5)   # taken by the thread, blocked in the index
    for key in keys(4, first_token=1000):
        store.put(key, payload(1))   # 4 placed, 3 evicted: 7 queued, 2 kept
    assert publisher.num_dropped == 5
    index.release.set()
    assert publisher.flush(timeout_s=5)
    assert len(index.events) == 1 + 2
    publisher.close()


def test_close_sends_what_is_queued_and_stops_its_thread():
    index = BlockingIndex()
    index.release.set()
    publisher = BackgroundPublisher(index)
    _store(publisher).put(keys(1)[0], payload(0))
    publisher.close()
    assert len(index.events) == 1
    assert not publisher._thread.is_alive()


def test_a_wait_for_the_events_so_far_is_not_extended_by_later_ones():
    """A save waits for its own entries: traffic after it does not keep it waiting."""
    index = BlockingIndex()
    publisher = BackgroundPublisher(index)
    store = _store(publisher)
    store.put(keys(1)[0], payload(0))
    mark = publisher.num_queued
    assert index.entered.wait(timeout=5)   # the thread took it; blocked in the index
    store.put(keys(1, first_token=700)[0], payload(1))   # a later change, queued behind
    assert not publisher.wait_sent(mark, timeout_s=0.05)
    index.release.set()
    assert publisher.wait_sent(mark, timeout_s=5)
    assert publisher.flush(timeout_s=5) and publisher.num_pending == 0
    publisher.close()

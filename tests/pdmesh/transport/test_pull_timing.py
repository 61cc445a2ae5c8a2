"""A slow pull is logged on both sides with when each step happened (pdmesh/transport/pull_timing.py)."""

from __future__ import annotations

import logging

from pdmesh.transport.pull_timing import PullTiming

LOGGER = logging.getLogger("test.pull_timing")


class FakeClock:
    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


def test_a_slow_pull_says_when_it_was_opened_and_each_message_went(caplog):
    clock = FakeClock()
    timing = PullTiming(LOGGER, "served", "t-1", "ipv4:127.0.0.1:9", clock=clock)
    clock.now += 0.25
    timing.opened()
    clock.now += 6.0
    timing.message()
    clock.now += 0.5
    timing.message()
    with caplog.at_level(logging.DEBUG, logger=LOGGER.name):
        timing.end("sent")
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.WARNING, "pull served t-1 (ipv4:127.0.0.1:9): opened at 0.25s, 2 messages, first at 6.25s, "
                          "last at 6.75s, ended at 6.75s: sent")]


def test_a_quick_pull_is_logged_only_at_debug(caplog):
    clock = FakeClock()
    timing = PullTiming(LOGGER, "pulled", "t-2", "127.0.0.1:7", clock=clock)
    with caplog.at_level(logging.INFO, logger=LOGGER.name):
        timing.end("failed: gone")
    assert caplog.records == []
    with caplog.at_level(logging.DEBUG, logger=LOGGER.name):
        timing.end("failed: gone")
    assert [r.getMessage() for r in caplog.records] == [
        "pull pulled t-2 (127.0.0.1:7): 0 messages, first at -, last at -, ended at 0.00s: failed: gone"]

"""When each message of a streamed pull went or came, logged for the pulls that took long: a pull
that waits for its first message points at a server that never served it, one that stops halfway at
a reader or a writer that stalled. At DEBUG every pull is logged (PDMESH_DEBUG_LOGGERS)."""

from __future__ import annotations

import logging
import time

SLOW_PULL_S = 5.0  # a pull that took longer is logged at WARNING


class PullTiming:
    """One pull, on one side (`side`: "served" on the producer, "pulled" on the consumer)."""

    def __init__(self, logger: logging.Logger, side: str, transfer_id: str, peer: str, clock=time.monotonic) -> None:
        self._logger = logger
        self._clock = clock
        self._what = f"{side} {transfer_id} ({peer})"
        self._started = clock()
        self._opened_s: float | None = None
        self._first_s: float | None = None
        self._last_s: float | None = None
        self.num_messages = 0

    def opened(self) -> None:
        """The producer found the transfer (it may wait for the engine to hold it)."""
        self._opened_s = self._clock() - self._started

    def message(self) -> None:
        self._last_s = self._clock() - self._started
        if self._first_s is None:
            self._first_s = self._last_s
        self.num_messages += 1

    def end(self, outcome: str) -> None:
        took_s = self._clock() - self._started
        level = logging.WARNING if took_s > SLOW_PULL_S else logging.DEBUG
        if self._logger.isEnabledFor(level):
            opened = "" if self._opened_s is None else f"opened at {self._opened_s:.2f}s, "
            self._logger.log(level, "pull %s: %s%d messages, first at %s, last at %s, ended at %.2fs: %s",
                             self._what, opened, self.num_messages, _seconds(self._first_s),
                             _seconds(self._last_s), took_s, outcome)


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}s"

"""Quiet when idle: a tick that found nothing logs at DEBUG; one INFO line sums the ticks up.

A poller on a one-second schedule ticks 86,400 times a day, and log ingestion is billed (Azure
Monitor). So ``tick done`` is an INFO line only when the tick sent rows; an idle tick's line
(nothing sent: caught up, the lease held elsewhere, backing off from a refusing broker) is
DEBUG, and at most every :data:`SUMMARY_SECONDS` one INFO line says what the ticks since the
last summary did: ``ticks``, ``idle_ticks``, ``rows`` and ``since``. The first tick after the
interval writes it, so a poller that stops ticking writes none.
"""

from __future__ import annotations

import datetime as dt
import threading
import time
from collections.abc import Callable

from shared.logs import get_logger, ids

__all__ = ["SUMMARY_SECONDS", "TickSummary"]

log = get_logger("poller.functions")

#: At most one summary line per poller this often (seconds).
SUMMARY_SECONDS = 300.0


class TickSummary:
    """One poller's tick log: per-tick lines (INFO when busy, DEBUG when idle) and the summary."""

    def __init__(
        self,
        poller: str,
        *,
        every: float = SUMMARY_SECONDS,
        monotonic: Callable[[], float] = time.monotonic,
        clock: Callable[[], dt.datetime] = lambda: dt.datetime.now(dt.UTC),
    ) -> None:
        self.poller = poller
        self.every = every
        self._monotonic = monotonic
        self._clock = clock
        self._lock = threading.Lock()
        self._start()

    def _start(self) -> None:
        self._since, self._started = self._clock(), self._monotonic()
        self._ticks = self._idle = self._rows = self._batches = 0

    def tick_done(self, stop_reason: str, rows: int, batches: int) -> None:
        """Log one tick (``tick done``) and, when the interval has passed, the summary."""
        idle = rows == 0  # nothing sent: caught up, lease held elsewhere, backing off from a refusing broker
        level = log.debug if idle else log.info
        level("tick done", extra=ids(poller=self.poller, stop_reason=stop_reason, rows=rows, batches=batches))
        with self._lock:
            self._ticks += 1
            self._idle += idle
            self._rows += rows
            self._batches += batches
            if self._monotonic() - self._started < self.every:
                return
            since, ticks, idle_ticks, total, sent = self._since, self._ticks, self._idle, self._rows, self._batches
            self._start()
        keys = ids(poller=self.poller, since=since.isoformat(), ticks=ticks, idle_ticks=idle_ticks, rows=total)
        log.info(
            "ticks since %s: %d (%d idle), %d rows sent in %d batches",
            since.isoformat(timespec="seconds"),
            ticks,
            idle_ticks,
            total,
            sent,
            extra=keys,
        )

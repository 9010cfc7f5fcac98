"""Timer triggers: each timer function fires on its schedule, on its own thread or, under the
local host, on the threads of a shared :class:`~dbfanout.host.timer_pool.TimerPool`.

Like the Functions host, a timer never overlaps itself: the next occurrence is computed after
the call returns, so occurrences missed while it ran are skipped, not queued. An invocation
later than its occurrence by more than ``past_due_after`` gets ``past_due=True``.
``run_on_startup`` fires once at start. (``use_monitor``'s schedule status is kept in memory
only: a restarted local host does not know what it missed while it was down.)
"""

from __future__ import annotations

import datetime as dt
import threading
import time
from collections.abc import Callable, Mapping

from azure.functions.timer import TimerRequest

from dbfanout.host.app_loader import FunctionSpec
from dbfanout.host.invoke import invoke
from dbfanout.host.runner import joined
from dbfanout.host.schedule import Schedule, parse_schedule
from dbfanout.host.timer_pool import TimerPool
from shared.logs import get_logger, ids

__all__ = ["TimerRunner"]

log = get_logger("host.timer")
Clock = Callable[[], dt.datetime]


def _utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


class TimerRunner:
    """Fires one timer function on its schedule until stopped."""

    def __init__(
        self,
        spec: FunctionSpec,
        settings: Mapping[str, str],
        *,
        clock: Clock = _utcnow,
        past_due_after: dt.timedelta = dt.timedelta(seconds=1),
        pool: TimerPool | None = None,
    ) -> None:
        self.spec = spec
        self.schedule: Schedule = parse_schedule(
            str(spec.trigger.get("schedule", "")), settings, key=f"{spec.name}.schedule"
        )
        self.run_on_startup = bool(spec.trigger.get("runOnStartup", False))
        self._clock = clock
        self._past_due_after = past_due_after
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pool = pool
        self._state = threading.Lock()  # a stop and the start of a pooled call exclude each other
        self._idle = threading.Event()  # set while no pooled call runs
        self._idle.set()
        self._last: dt.datetime | None = None
        self._next: dt.datetime | None = None  # the occurrence after the last fired one
        self.invocations = 0
        self.failures = 0

    def start(self) -> None:
        if self._pool is not None:
            self._pool.add(self, None if self.run_on_startup else self._due_after(self._clock()))
            return
        self._thread = threading.Thread(target=self._loop, name=f"timer:{self.spec.name}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop firing; a call in progress runs to its end (see :meth:`join`)."""
        with self._state:
            if self._stop.is_set():
                return
            self._stop.set()
        if self._pool is not None:
            self._pool.removed()

    def join(self, timeout: float) -> bool:
        """Wait for the thread (or the pooled call in progress); True when it ended within ``timeout``."""
        if self._pool is not None:
            return self._idle.wait(timeout)
        return joined(self._thread, timeout)

    # -- what a TimerPool asks -------------------------------------------------------------------

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    def now(self) -> dt.datetime:
        return self._clock()

    def fire_due(self, due: dt.datetime) -> None:
        """The firing of occurrence ``due`` on a pool's thread (nothing once stopped)."""
        with self._state:
            if self._stop.is_set():
                return
            self._idle.clear()
        try:
            self.fire(due, past_due=self._clock() - due > self._past_due_after)
        finally:
            self._idle.set()

    def due_after_call(self) -> dt.datetime:
        """The next occurrence to fire, computed after a call returned (missed ones are skipped)."""
        return self._due_after(self._clock())

    def _loop(self) -> None:
        if self.run_on_startup and not self._stop.is_set():
            self.fire(self._clock(), past_due=False)
        while not self._stop.is_set():
            due = self._due_after(self._clock())
            if self._wait_until(due):
                return
            started = self._clock()
            self.fire(due, past_due=started - due > self._past_due_after)

    def _due_after(self, now: dt.datetime) -> dt.datetime:
        """The first occurrence after ``now``: the one :meth:`fire` computed for its schedule
        status when the call ended before it (no occurrence lies between), else the schedule's
        (always for a TimeSpan, whose next firing counts from the end of the call).
        Each evaluation of an NCRONTAB expression costs about 20 µs, a tenth of an idle tick."""
        nxt, last = self._next, self._last
        if self.schedule.interval is None and nxt is not None and last is not None and last <= now < nxt:
            return nxt
        return self.schedule.next_after(now)

    def _wait_until(self, due: dt.datetime) -> bool:
        """Sleep until ``due``; True when stopped meanwhile."""
        while True:
            remaining = (due - self._clock()).total_seconds()
            if remaining <= 0:
                return self._stop.is_set()
            if self._stop.wait(min(remaining, 1.0)):
                return True

    def fire(self, scheduled: dt.datetime, *, past_due: bool) -> None:
        """One invocation with a TimerRequest filled like the host's (errors are logged, not raised)."""
        nxt = self.schedule.next_after(scheduled)
        request = TimerRequest(
            past_due=past_due,
            schedule_status={
                "Last": (self._last or scheduled).isoformat(),
                "Next": nxt.isoformat(),
                "LastUpdated": self._clock().isoformat(),
            },
            schedule={"AdjustForDST": True},
        )
        self._last, self._next = scheduled, nxt
        started = time.perf_counter()
        try:
            result = invoke(self.spec, request)
            if result is not None:
                # The Python worker fails an invocation whose timer function returns a value.
                raise TypeError(f"timer function {self.spec.name} returned {type(result).__name__}, not None")
        except Exception as exc:  # a failed tick is logged; the schedule goes on, as on Azure
            self.failures += 1
            log.error(
                "timer function failed",
                exc_info=exc,
                extra=ids(function=self.spec.name, error=type(exc).__name__, past_due=past_due),
            )
        finally:
            self.invocations += 1
        log.debug(
            "timer function ran",
            extra=ids(function=self.spec.name, seconds=round(time.perf_counter() - started, 3), past_due=past_due),
        )

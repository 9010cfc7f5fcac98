"""The threads the local host's timers fire on: one scheduler and as few workers as keep up.

A thread per timer made 100 idle pollers wake 100 threads at every second, which then took the
GIL from each other around each one's database round trip: about 0.35 ms of CPU per tick more
than the same ticks run one after another on two threads (BENCHMARKS.md, issue 31). Here one
scheduler thread waits for the next occurrence of any timer and queues the due firings; workers
take them in order. Only one worker is woken for a batch of firings; when no worker took a
queued firing for :data:`GRACE_SECONDS` (the awake ones are in long calls: lingering or
catching-up ticks), the awake workers are doubled (idle ones woken first, new ones started), so
slow calls delay the others by a few graces (log2 of their number), never by their own length.
A worker idle for :data:`IDLE_SECONDS` ends, down to one.

A timer is queued again only after its call returned (it never overlaps itself); occurrences
missed meanwhile are skipped, as :class:`~dbfanout.host.timers.TimerRunner` does on its own thread.
"""

from __future__ import annotations

import datetime as dt
import heapq
import itertools
import threading
import time
from collections import deque
from typing import Protocol

from dbfanout.host.app_loader import FunctionSpec
from shared.logs import get_logger, ids

__all__ = ["GRACE_SECONDS", "IDLE_SECONDS", "PooledTimer", "TimerPool"]

log = get_logger("host.timer")

#: How long queued firings may wait with no worker taking one before more workers are woken or started.
GRACE_SECONDS = 0.02
#: A worker idle this long ends (one stays): the workers started for slow first ticks do not stay.
IDLE_SECONDS = 10.0


class PooledTimer(Protocol):
    """What the pool asks of a timer (:class:`~dbfanout.host.timers.TimerRunner`)."""

    spec: FunctionSpec

    @property
    def stopped(self) -> bool: ...

    def now(self) -> dt.datetime: ...

    def fire_due(self, due: dt.datetime) -> None:
        """Call the function for occurrence ``due`` (its errors logged, not raised)."""

    def due_after_call(self) -> dt.datetime:
        """The next occurrence to fire, after a call returned."""


class TimerPool:
    """Fires registered timers on shared threads."""

    def __init__(self, grace_seconds: float = GRACE_SECONDS, idle_seconds: float = IDLE_SECONDS) -> None:
        self._grace = grace_seconds
        self._idle_seconds = idle_seconds
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)  # workers wait here for firings
        self._tick = threading.Condition(self._lock)  # the scheduler waits here
        self._heap: list[tuple[dt.datetime, int, PooledTimer]] = []  # (due, order, timer)
        self._order = itertools.count()
        self._ready: deque[tuple[float, dt.datetime, PooledTimer]] = deque()  # (queued at, due, timer)
        self._workers = 0
        self._idle = 0
        self._starting = 0  # workers started that have not looked for a firing yet
        self._grown_at = 0.0  # when workers were last added for waiting firings
        self._started_at = 0.0  # when a worker last took a firing
        self._timers = 0  # registered and not stopped
        self._scheduler: threading.Thread | None = None
        self.threads_started = 0  # workers ever started

    @property
    def workers(self) -> int:
        """Worker threads alive now."""
        with self._lock:
            return self._workers

    # -- the timers' side -------------------------------------------------------------------

    def add(self, timer: PooledTimer, due: dt.datetime | None) -> None:
        """Schedule ``timer`` at ``due`` (None: now, ``runOnStartup``); start the scheduler once."""
        with self._lock:
            self._timers += 1
            if due is None:
                self._queue(timer, timer.now())
            else:
                heapq.heappush(self._heap, (due, next(self._order), timer))
            if self._scheduler is None:
                self._scheduler = threading.Thread(target=self._schedule, name="timer:scheduler", daemon=True)
                self._scheduler.start()
            self._tick.notify()

    def removed(self) -> None:
        """A timer stopped; with none left the threads end (their calls run to their end first)."""
        with self._lock:
            self._timers -= 1
            if self._timers <= 0:
                self._tick.notify()
                self._work.notify_all()

    # -- the scheduler ----------------------------------------------------------------------

    def _schedule(self) -> None:
        with self._lock:
            while self._timers > 0:
                self._queue_due()
                self._staff()
                self._tick.wait(self._sleep())
            self._scheduler = None

    def _queue_due(self) -> None:
        while self._heap:
            due, _, timer = self._heap[0]
            if due > timer.now():
                return
            heapq.heappop(self._heap)
            if not timer.stopped:
                self._queue(timer, due)

    def _queue(self, timer: PooledTimer, due: dt.datetime) -> None:
        self._ready.append((time.monotonic(), due, timer))

    def _staff(self) -> None:
        """One awake worker for queued firings; twice as many when none was taken for the grace
        (the awake ones are in long calls). Workers that keep taking firings are enough: more
        would only take the GIL from each other."""
        if not self._ready:
            return
        awake = self._workers - self._idle
        # Never more new workers than firings waiting for one: workers started that have not
        # looked yet will each take one (counted as awake too: a pool that doubled on those ran
        # away to 20,000 threads; one that started a worker per waiting firing again, while slow
        # thread starts kept the last ones from taking theirs, started 28 for 20 blocked calls).
        short = len(self._ready) - self._starting
        if short <= 0:
            return
        if awake == 0:
            self._more(1)
        elif time.monotonic() >= self._next_look():
            self._more(min(awake, short))

    def _more(self, n: int) -> None:
        self._grown_at = time.monotonic()
        wake = min(n, self._idle)
        self._starting += n - wake
        for _ in range(wake):
            self._work.notify()
        for _ in range(n - wake):
            self._workers += 1
            self.threads_started += 1
            threading.Thread(target=self._serve, name="timer:worker", daemon=True).start()

    def _sleep(self) -> float | None:
        """Seconds until the next due occurrence or the oldest firing's grace ends (None: no timer)."""
        waits = []
        if self._heap:
            due, _, timer = self._heap[0]
            waits.append((due - timer.now()).total_seconds())
        if self._ready:
            waits.append(self._next_look() - time.monotonic())
        return max(0.0, min(waits)) if waits else None

    def _next_look(self) -> float:
        """When waiting firings next justify more workers: a grace after the last firing taken,
        the oldest queued and the last growth (the scheduler sleeps until then, never spins)."""
        return max(self._started_at, self._ready[0][0], self._grown_at) + self._grace

    # -- the workers ------------------------------------------------------------------------

    def _serve(self) -> None:
        with self._lock:
            self._starting -= 1  # started: looking now
            while True:
                if self._ready:
                    _, due, timer = self._ready.popleft()
                    self._started_at = time.monotonic()
                    self._lock.release()
                    try:
                        nxt = self._fire(timer, due)
                    finally:
                        self._lock.acquire()
                    if nxt is not None:
                        entry = (nxt, next(self._order), timer)
                        heapq.heappush(self._heap, entry)
                        if self._heap[0] is entry:  # earlier than what the scheduler waits for
                            self._tick.notify()
                elif self._timers <= 0:
                    self._workers -= 1
                    return
                else:
                    self._idle += 1
                    notified = self._work.wait(self._idle_seconds)
                    self._idle -= 1
                    if not notified and not self._ready and self._workers > 1:
                        self._workers -= 1  # a wake-up meant for it finds another (or the next look)
                        return

    @staticmethod
    def _fire(timer: PooledTimer, due: dt.datetime) -> dt.datetime | None:
        """One call (errors are the timer's to log); the timer's next due, None once it stopped."""
        try:
            timer.fire_due(due)
        except Exception as exc:  # fire logs the function's errors; this is the pool's own
            log.error("timer firing failed", exc_info=exc, extra=ids(function=timer.spec.name))
        return None if timer.stopped else timer.due_after_call()

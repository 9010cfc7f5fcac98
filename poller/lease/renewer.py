"""The process's one lease-renewer thread: it renews the keeper of every running tick (R11).

Apart from :mod:`poller.lease.keeper` because it knows nothing of the lease but
:meth:`Renewable.renew_once`; the keeper registers itself for a tick's duration.
"""

from __future__ import annotations

import math
import threading
import time
from typing import Protocol

__all__ = ["RENEWALS", "Renewable", "Renewals"]


class Renewable(Protocol):
    """What the renewer asks of a keeper (:class:`~poller.lease.keeper.LeaseKeeper`)."""

    def renew_once(self) -> bool:
        """One background renewal (never raises). False when the lease is lost: stop renewing it."""
        ...


class Renewals:
    """One daemon thread renews the keepers of every running tick of the process (R11).

    A tick registers its keeper for its duration (:meth:`~poller.lease.keeper.LeaseKeeper.renewing_in_background`);
    the thread calls :meth:`~poller.lease.keeper.LeaseKeeper.renew_once` on each keeper every ``interval``. A keeper
    whose commit is in flight is skipped for that round (the commit extends the lease). A thread
    started and joined per tick cost about a fifth of an idle tick's CPU (BENCHMARKS.md, issue 23).

    A keeper added is only worth waking the thread for when it is due before the thread's own
    wake-up: an idle tick ends long before its first renewal, and waking the thread at each of
    100 ticks a second cost a thread switch each (BENCHMARKS.md, issue 31). With no keeper the
    thread looks again after the last keeper's interval, so the next tick's keeper (due one
    interval after it starts) is never earlier than that.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._due: dict[Renewable, tuple[float, float]] = {}  # keeper -> (interval, next renewal)
        self._running: Renewable | None = None
        self._thread: threading.Thread | None = None
        self._wakes_at = -math.inf  # when the waiting thread wakes by itself
        self._idle_wait = 1.0  # how long it waits with no keeper: the last keeper's interval
        self.wakes = 0  # times the thread woke to look at the keepers (tests)

    def add(self, keeper: Renewable, interval: float) -> None:
        with self._cond:
            due = time.monotonic() + interval
            self._due[keeper] = (interval, due)
            self._idle_wait = interval
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="lease-renewer", daemon=True)
                self._thread.start()
            if due < self._wakes_at:
                self._cond.notify_all()

    def remove(self, keeper: Renewable) -> None:
        with self._cond:
            self._due.pop(keeper, None)
            while self._running is keeper:
                self._cond.wait()

    def _run(self) -> None:
        while True:
            with self._cond:
                keeper = self._next_due()
                self._running = keeper
            try:
                keep = keeper.renew_once()
            finally:
                with self._cond:
                    if not keep:
                        self._due.pop(keeper, None)
                    self._running = None
                    self._cond.notify_all()

    def _next_due(self) -> Renewable:
        """Under the condition: wait for the keeper due first, and schedule its next renewal."""
        while True:
            if not self._due:  # look again after the last interval: a tick added by then needs no notify
                self._wakes_at = time.monotonic() + self._idle_wait
                self._cond.wait(self._idle_wait)
            else:
                keeper, (interval, due) = min(self._due.items(), key=lambda item: item[1][1])
                wait = due - time.monotonic()
                if wait <= 0:
                    self._wakes_at = -math.inf  # renewing, not waiting: add() need not notify
                    self._due[keeper] = (interval, time.monotonic() + interval)
                    return keeper
                self._wakes_at = due
                self._cond.wait(wait)
            self.wakes += 1


RENEWALS = Renewals()

"""Checkpoint commits off the fetch/send path: group commit with a bounded lag.

A checkpoint write costs a storage round trip (milliseconds) while a page of rows costs about as
much to fetch and send. :class:`Committer` lets the tick fetch and send page N+1 while the commit
of page N is in flight, and one write covers several accepted pages (it carries the newest
position). A write starts once three quarters of ``max_uncommitted`` pages wait for one (the
last quarter is sent while it is in flight), or at once when the tick waits for it (end of the
tick, or no room left). Invariants, the same as committing inline:

* a checkpoint is written only for pages the sink has accepted, newest last (never ahead);
* at most ``max_uncommitted`` accepted pages are not yet covered by a landed write: the tick
  waits before sending another (so a crash re-sends at most that many pages);
* the first failed write stops the committer; the tick sees the error at its next step.

``max_uncommitted = 1`` commits inline, in the tick's own thread: fetch → send → commit → fetch,
the brief's strict order, with no thread at all.

Threads and locks (this committer, the :class:`~poller.lease.keeper.LeaseKeeper` and its renewer): see
the rules in :class:`~poller.lease.keeper.LeaseKeeper`'s docstring, the one place they are written.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

__all__ = ["Committer", "Landed"]

T = TypeVar("T")  # what one write needs: the tick passes a Checkpoint


@dataclass(frozen=True, slots=True)
class Landed:
    """What the landed writes cover so far."""

    rows: int = 0
    batches: int = 0


class Committer(Generic[T]):
    """Runs ``commit(item)`` for accepted pages; inline, or on one background thread."""

    def __init__(self, commit: Callable[[T], None], max_uncommitted: int, *, name: str = "committer") -> None:
        if max_uncommitted < 1:
            raise ValueError("max_uncommitted must be at least 1")
        self._commit = commit
        self._max = max_uncommitted
        self._cond = threading.Condition()
        self._pending: tuple[T, int, int] | None = None  # newest item, rows, batches
        self._last: T | None = None  # the newest item handed over
        self._submitted = 0  # batches handed over
        self._landed = Landed()
        # Pages per write while catching up; the rest of the room is sent while the write is in flight.
        self._group = max(1, max_uncommitted * 3 // 4)
        self._waiting = 0  # callers blocked in wait_for_room/flush: write whatever is pending now
        self._error: BaseException | None = None
        self._closing = False
        self._thread: threading.Thread | None = None
        self._threaded = max_uncommitted > 1
        self._name = name

    @property
    def landed(self) -> Landed:
        with self._cond:
            return self._landed

    @property
    def last_submitted(self) -> T | None:
        """The newest item handed over (landed or not); None before the first."""
        with self._cond:
            return self._last

    def wait_for_room(self) -> None:
        """Block until another page may be sent (fewer than ``max_uncommitted`` uncovered)."""
        with self._cond:
            self._wait_until(lambda: self._submitted - self._landed.batches < self._max)

    def submit(self, item: T, rows: int) -> None:
        """Hand over the write for a page the sink accepted (positions only move forward)."""
        if not self._threaded:
            self._last = item
            self._commit(item)  # inline: the error propagates from here
            self._landed = Landed(self._landed.rows + rows, self._landed.batches + 1)
            self._submitted += 1
            return
        if self._thread is None:  # started by the first page: a tick that sends nothing starts no thread
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()
        with self._cond:
            self._raise_error()
            self._last = item
            _, pending_rows, pending_batches = self._pending or (item, 0, 0)
            self._pending = (item, pending_rows + rows, pending_batches + 1)
            self._submitted += 1
            if self._due():  # wake the writer only when it has work: a woken thread contends for the GIL
                self._cond.notify_all()

    def flush(self) -> Landed:
        """Wait until every submitted page is covered by a landed write; raise the first failure."""
        with self._cond:
            self._raise_error()
            if self._closing and self._landed.batches < self._submitted:
                raise RuntimeError("the committer was closed with pages not yet written; flush before close")
            self._wait_until(lambda: self._landed.batches >= self._submitted)
            return self._landed

    def close(self) -> None:
        """Stop the thread. Pending pages stay uncommitted (call :meth:`flush` first to land them)."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()

    def _wait_until(self, done: Callable[[], bool]) -> None:
        """Under the lock: wait (urging the writer) until ``done()`` or a failed write."""
        if self._thread is not None and not done() and self._error is None:
            self._waiting += 1
            self._cond.notify_all()
            try:
                while self._error is None and not done():
                    self._cond.wait()
            finally:
                self._waiting -= 1
        self._raise_error()

    def _due(self) -> bool:
        return self._pending is not None and (self._pending[2] >= self._group or self._waiting > 0)

    def _raise_error(self) -> None:
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._due() and not self._closing:
                    self._cond.wait()
                if self._closing or self._pending is None:
                    return
                (item, rows, batches), self._pending = self._pending, None
            try:
                self._commit(item)
            except BaseException as exc:  # stored: the tick raises it at its next step
                with self._cond:
                    self._error = exc
                    self._cond.notify_all()
                return
            with self._cond:
                self._landed = Landed(self._landed.rows + rows, self._landed.batches + batches)
                self._cond.notify_all()

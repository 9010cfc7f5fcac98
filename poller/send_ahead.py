"""Sending a page while the tick packs the next one.

A page's send is mostly a round trip: the SDK waits on its socket (without the GIL) for the
broker to accept the messages. With a :class:`~poller.ports.SplitSink` the tick packs page N+1 on
its own thread while page N's delivery is in flight on this one, instead of idling through it.

Invariants, the same as sending inline:

* one delivery in flight at a time, in page order, on the sink's one sender: the broker gets
  the messages in the order an inline tick sends them (sessions keep their per-key order);
* a page counts as accepted (its checkpoint goes to the committer) only once its delivery
  returned, and only on the tick's thread (:meth:`SendAhead.finish`);
* a delivery's failure is raised by the next :meth:`SendAhead.finish`, on the tick's thread;
* a tick never leaves a delivery running: :meth:`SendAhead.close` waits for it.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Generic, TypeVar

__all__ = ["SendAhead"]

P = TypeVar("P")  # what one delivery sends: the tick passes a PreparedSend


class SendAhead(Generic[P]):
    """Runs ``deliver(prepared)`` on one background thread, one at a time."""

    def __init__(self, deliver: Callable[[P], None], *, name: str) -> None:
        self._deliver = deliver
        self._name = name
        self._executor: ThreadPoolExecutor | None = None  # started by the first delivery
        self._in_flight: tuple[Future[None], Callable[[], None]] | None = None

    @property
    def in_flight(self) -> bool:
        return self._in_flight is not None

    def start(self, prepared: P, accepted: Callable[[], None]) -> None:
        """Deliver ``prepared`` in the background; ``accepted`` runs on the caller's thread at the
        :meth:`finish` that sees it succeed. Call :meth:`finish` first: one delivery at a time."""
        if self._in_flight is not None:
            raise RuntimeError("a delivery is still in flight; finish() it before starting the next")
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"send-{self._name}")
        self._in_flight = (self._executor.submit(self._deliver, prepared), accepted)

    def finish(self) -> None:
        """Wait for the delivery in flight (if any): run its ``accepted``, or raise its error."""
        if self._in_flight is None:
            return
        (future, accepted), self._in_flight = self._in_flight, None
        future.result()
        accepted()

    def settle(self) -> BaseException | None:
        """After a failure elsewhere: wait for the delivery in flight; run its ``accepted`` if it
        succeeded (fewer pages re-sent), else return its error (the caller's failure prevails)."""
        try:
            self.finish()
        except BaseException as exc:
            return exc
        return None

    def close(self) -> None:
        """Wait for any delivery still running and stop the thread (its outcome is dropped: call
        :meth:`finish` or :meth:`settle` first to use it)."""
        self._in_flight = None
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

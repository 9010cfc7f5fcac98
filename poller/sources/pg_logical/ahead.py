"""Reading the slot ahead of the send: one decoded buffer per tick, shared by the threads that read it.

The tick reads a pg_logical page's changes from the slot, decodes them and hands them to the
snapshot coordinator; then it encodes, sends and commits them. With read-ahead
(:class:`~poller.tick.prefetch.Prefetcher`, ``max_uncommitted_batches`` > 1) the next pages are
peeked and decoded on a reader thread while the tick sends the previous ones: the server decodes
and the driver waits on its socket without the GIL meanwhile, which one thread doing both in turn
never overlaps.

Why a buffer per tick and not per thread: a peek decodes about four pages, and the reader thread
takes over after the tick's first page. With a buffer of its own it would peek again and decode
those pages a second time (the slot does not move within a tick); with this one it goes on from
the tick's buffer, and a lingering tick's next drain goes on from the reader's. Fetches stay
serial (the tick's first page, then the reader's pages, then the reader is joined before the
tick fetches again), so the buffer needs no lock; only the pin count does.

Nothing here moves the checkpoint or the slot: pages read ahead of a tick that stops are dropped
unsent, and the slot advances only to a landed checkpoint (:mod:`poller.sources.pg_logical.advance`).
"""

from __future__ import annotations

import threading

from poller.sources.pg_logical.peek import Buffer

__all__ = ["TickBuffer"]


class TickBuffer:
    """The decoded changes of the tick in progress, whichever of its threads read them last."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pins = 0
        self.buffer: Buffer | None = None

    def enter(self) -> bool:
        """A thread of the tick pins the source: True for the tick's own (outermost) pin, which starts afresh."""
        with self._lock:
            self._pins += 1
            if self._pins == 1:
                self.buffer = None
            return self._pins == 1

    def leave(self) -> None:
        """A pin ends; the tick's own drops the buffer (the slot moves after the tick)."""
        with self._lock:
            self._pins -= 1
            if self._pins == 0:
                self.buffer = None

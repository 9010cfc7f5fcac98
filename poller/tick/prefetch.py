"""Reading the next keyset page while the tick sends the current one.

A keyset page's query depends only on where the previous page ended, so page N+1 can be read as
soon as page N is, while N is encoded and sent. The database works (and the driver waits on its
socket, without the GIL) while the tick's thread encodes. Nothing else changes: pages are still
sent, and checkpoints committed, in order, and a page read ahead of a tick that stops (time budget,
a failure) is dropped unsent: the next tick reads it again from the checkpoint.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager

from poller.ports import Page
from shared.models import Position

__all__ = ["PageReader", "Prefetcher", "Sequential"]

_HAND_BACK = object()  # the thread stopped reading ahead: the taker reads on (Prefetcher's reads_on)


class PageReader:
    """The pages of one tick, in keyset order."""

    def next(self) -> Page:
        raise NotImplementedError

    def close(self) -> None:
        """Stop reading ahead (a page read but not taken is dropped)."""


class Sequential(PageReader):
    """Each page read when asked for, on the tick's thread (sources with side effects, strict order)."""

    def __init__(self, fetch: Callable[[Position | None], Page], first: Position | None) -> None:
        self._fetch = fetch
        self._position = first

    def next(self) -> Page:
        page = self._fetch(self._position)
        self._position = page.end if len(page) else self._position
        return page


class Prefetcher(PageReader):
    """Reads up to ``max_pages`` pages on its own thread, one page ahead of the taker.

    The first page is read on the taker's thread; the thread starts only when that page is full
    (more may follow), so a tick that finds little or nothing costs no thread.

    It stops after a short page (caught up), as the tick does. A fetch error is raised by the
    :meth:`next` that would have returned that page.

    ``reads_on(page)``: whether the page after ``page`` may be read ahead (default: always). When
    it says no (a pg_logical snapshot runs: its chunk reads write watermarks, and their timing
    against the pages' sends is the one a sequential tick has), the thread stops and the taker
    reads the rest of the drain's pages itself, in order.

    ``deadline`` (on ``clock``): the thread starts no read after it, and hands the reading back
    the same way: the tick stops at about that time, and a read in flight then would hold the
    tick's end (its :meth:`close`) until it returned.
    """

    def __init__(
        self,
        fetch: Callable[[Position | None], Page],
        first: Position | None,
        *,
        limit: int,
        max_pages: int,
        pinned: Callable[[], AbstractContextManager[None]],
        name: str,
        reads_on: Callable[[Page], bool] = lambda _page: True,
        deadline: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._deadline, self._clock = deadline, clock
        self._fetch, self._first, self._limit, self._max_pages, self._pinned = fetch, first, limit, max_pages, pinned
        self._reads_on = reads_on
        self._handed_back: Position | None = None  # where the taker reads on, once the thread stopped by choice
        self._taker_reads = False
        self._pages: queue.Queue[Page | BaseException | object] = queue.Queue(maxsize=1)
        self._stop = threading.Event()
        self._name = name
        self._thread: threading.Thread | None = None
        self._started = False  # the first page is read by the taker; the thread reads the rest

    def _start(self, after: Position | None) -> None:
        self._thread = threading.Thread(target=self._run, args=(after,), name=f"prefetch-{self._name}", daemon=True)
        self._thread.start()

    def _run(self, after: Position | None) -> None:
        try:
            with self._pinned():  # one pooled connection for the tick, on this thread
                position = after
                for _ in range(self._max_pages - 1):
                    if self._stop.is_set():
                        return
                    if self._deadline is not None and self._clock() >= self._deadline:
                        self._handed_back = position  # past the tick's deadline: the taker reads on, if at all
                        self._put(_HAND_BACK)
                        return
                    page = self._fetch(position)
                    if not self._reads_on(page):
                        self._handed_back = page.end  # set before the put: the taker reads on from it
                    if not self._put(page) or page.caught_up(self._limit) or not len(page):
                        return  # caught up, or an empty page (the tick stops at it: it only moves the checkpoint)
                    if self._handed_back is not None:
                        self._put(_HAND_BACK)  # the taker reads the next page itself
                        return
                    position = page.end
        except BaseException as exc:  # handed to the taker, which raises it in the tick's thread
            self._put(exc)

    def _put(self, item: Page | BaseException | object) -> bool:
        while not self._stop.is_set():
            try:
                self._pages.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def next(self) -> Page:
        if not self._started:
            # The first page on the taker's thread: an idle tick (a short first page) starts no thread.
            self._started = True
            page = self._fetch(self._first)
            if not page.caught_up(self._limit) and len(page) and self._max_pages > 1:
                if self._reads_on(page):
                    self._start(page.end)
                else:
                    self._taker_reads, self._handed_back = True, page.end
            return page
        if self._taker_reads:
            return self._read_here()
        while True:
            if self._thread is None:
                raise RuntimeError("the page reader stopped before the tick asked for its last page")
            try:
                item = self._pages.get(timeout=0.5)
            except queue.Empty:
                if not self._thread.is_alive() and self._pages.empty():
                    raise RuntimeError("the page reader stopped before the tick asked for its last page") from None
                continue
            if isinstance(item, BaseException):
                raise item
            if item is _HAND_BACK:
                self._taker_reads = True  # the thread stopped by choice after its last page
                return self._read_here()
            assert isinstance(item, Page)
            return item

    def _read_here(self) -> Page:
        """The next page on the taker's thread (after the thread handed the reading back)."""
        page = self._fetch(self._handed_back)
        self._handed_back = page.end if len(page) else self._handed_back
        return page

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

"""poller.tick.prefetch: pages read one ahead on their own thread come in keyset order, and nothing
read ahead is ever sent by a tick that stops (the next tick reads it again from the checkpoint)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from poller.ports import Page, SourceRow
from poller.tick.prefetch import Prefetcher, Sequential
from shared.models import Position

LIMIT = 3


class Table:
    """``rows`` ids, read ``LIMIT`` at a time after a position; records each read and its thread."""

    def __init__(self, rows: int, fail_after: int | None = None) -> None:
        self.rows, self.fail_after = rows, fail_after
        self.reads: list[int | None] = []
        self.threads: set[str] = set()
        self.pinned_threads: set[str] = set()
        self.read_threads: list[str] = []  # per read, in order

    def fetch(self, after: Position | None) -> Page:
        start = 0 if after is None else after.pk["id"]
        self.reads.append(start)
        self.threads.add(threading.current_thread().name)
        self.read_threads.append(threading.current_thread().name)
        if self.fail_after is not None and start >= self.fail_after:
            raise ConnectionError(f"database gone at {start}")
        ids = range(start + 1, min(start + LIMIT, self.rows) + 1)
        return Page([SourceRow(Position(cursor=i, pk={"id": i}), {"id": i}) for i in ids])

    @contextmanager
    def pinned(self) -> Iterator[None]:
        self.pinned_threads.add(threading.current_thread().name)
        yield


def _prefetcher(table: Table, max_pages: int = 100) -> Prefetcher:
    return Prefetcher(table.fetch, None, limit=LIMIT, max_pages=max_pages, pinned=table.pinned, name="t")


def _ids(page: Page) -> list[int]:
    return [r.values["id"] for r in page.rows]


def test_pages_come_in_order_read_on_the_readers_pinned_thread_and_stop_after_a_short_page() -> None:
    table = Table(rows=8)
    reader = _prefetcher(table)
    try:
        pages = [_ids(reader.next()) for _ in range(3)]
    finally:
        reader.close()
    assert pages == [[1, 2, 3], [4, 5, 6], [7, 8]]
    assert table.reads == [0, 3, 6]  # nothing after the short page
    # The first page on the taker's thread (pinned by the tick), the rest on the reader's pinned one
    assert table.threads == {threading.current_thread().name, "prefetch-t"}
    assert table.pinned_threads == {"prefetch-t"}


def test_a_short_first_page_starts_no_thread() -> None:
    # Given an idle source (fewer rows than a page), When the tick reads its first page
    table = Table(rows=2)
    reader = _prefetcher(table)
    try:
        assert _ids(reader.next()) == [1, 2]
        # Then it was read on the taker's thread and no reader thread was started
        assert table.threads == {threading.current_thread().name}
        assert not any(t.name == "prefetch-t" for t in threading.enumerate())
    finally:
        reader.close()
    assert table.reads == [0]


def test_a_fetch_error_is_raised_by_the_next_that_would_have_returned_its_page() -> None:
    table = Table(rows=100, fail_after=3)
    reader = _prefetcher(table)
    try:
        assert _ids(reader.next()) == [1, 2, 3]
        with pytest.raises(ConnectionError, match="database gone at 3"):
            reader.next()
    finally:
        reader.close()


def test_close_drops_what_was_read_ahead_and_stops_reading() -> None:
    table = Table(rows=1000)
    reader = _prefetcher(table)
    assert _ids(reader.next()) == [1, 2, 3]
    reader.close()  # e.g. the time budget ran out: the page read ahead is not sent by this tick
    reads = len(table.reads)
    assert reads <= 3  # the page taken, at most one waiting, at most one being read
    assert not any(t.name == "prefetch-t" for t in threading.enumerate())


def test_at_most_max_pages_are_read() -> None:
    table = Table(rows=1000)
    reader = _prefetcher(table, max_pages=2)
    try:
        assert [_ids(reader.next()) for _ in range(2)] == [[1, 2, 3], [4, 5, 6]]
    finally:
        reader.close()
    assert table.reads == [0, 3]


def test_sequential_reads_each_page_when_asked() -> None:
    table = Table(rows=5)
    reader = Sequential(table.fetch, None)
    assert _ids(reader.next()) == [1, 2, 3] and table.reads == [0]
    assert _ids(reader.next()) == [4, 5] and table.reads == [0, 3]
    assert table.threads == {threading.current_thread().name}


@pytest.mark.parametrize("stop_after", [3, 6], ids=["after-the-first-page", "after-a-read-ahead-page"])
def test_a_page_that_must_not_be_read_past_ahead_hands_the_reading_back_to_the_taker(stop_after: int) -> None:
    # Given a source whose pages after id ``stop_after`` must be read in turn (a pg_logical snapshot runs)
    table = Table(rows=14)
    reader = Prefetcher(table.fetch, None, limit=LIMIT, max_pages=100, pinned=table.pinned, name="t",
                        reads_on=lambda page: page.rows[-1].values["id"] < stop_after)  # fmt: skip
    taker = threading.current_thread().name
    try:
        # When the tick takes every page
        pages = [_ids(reader.next()) for _ in range(5)]
    finally:
        reader.close()
    # Then they come in order, each read once, and the ones after the stop on the taker's thread
    assert pages == [[1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 11, 12], [13, 14]]
    assert table.reads == [0, 3, 6, 9, 12]
    first_here, threads = stop_after // LIMIT, table.read_threads
    assert threads[first_here:] == [taker] * (5 - first_here)
    assert set(threads[1:first_here]) <= {"prefetch-t"}


def test_past_its_deadline_the_reader_starts_no_read_and_the_taker_reads_on() -> None:
    # Given a reader whose tick's deadline passes after the first page
    table = Table(rows=14)
    now = [0.0]
    reader = Prefetcher(table.fetch, None, limit=LIMIT, max_pages=100, pinned=table.pinned, name="t",
                        deadline=1.0, clock=lambda: now[0])  # fmt: skip
    try:
        now[0] = 2.0
        # When the tick still takes pages (a last page past the deadline)
        pages = [_ids(reader.next()) for _ in range(3)]
    finally:
        reader.close()
    # Then they come in order, each read once, all on the taker's thread (no read was in flight at the end)
    assert pages == [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert table.reads == [0, 3, 6]
    assert set(table.read_threads) == {threading.current_thread().name}

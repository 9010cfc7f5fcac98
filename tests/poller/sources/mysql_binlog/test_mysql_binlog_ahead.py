"""kind = "mysql_binlog" read ahead (issue 41): the binlog is read and its rows decoded on a reader
thread while the tick sends the previous pages (poller.tick.prefetch); the checkpoint still moves
only after the hand-off landed, in binlog order, and a stream ahead of the checkpoint skips nothing.

The source supports it but has it off (measured no faster: see ``prefetch_pages``); these tests
opt in with a subclass, so that turning it on is one line.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from poller.ports import Page
from poller.sources.mysql_binlog.source import MysqlBinlogSource
from poller.state.memory import MemoryStateStore
from poller.tick.lifecycle import run_tick
from shared.errors import EnqueueError
from shared.models import Batch, Position, SnapshotState
from tests.poller.mysql_binlog_support import BinlogTables, binlog_tables
from tests.poller.tick_support import RecordingSink, drain

pytestmark = pytest.mark.integration


@pytest.fixture
def tables(mysql_binlog_url: str) -> Iterator[BinlogTables]:
    with binlog_tables(mysql_binlog_url) as made:
        yield made


class _ThreadsSeen(MysqlBinlogSource):
    """The real source with read-ahead on (unless ``ahead`` is False), noting which thread read each page."""

    def __init__(self, *args: Any, ahead: bool = True, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.threads: list[str] = []
        self._ahead = ahead

    @property
    def prefetch_pages(self) -> bool:
        return self._ahead

    def fetch(self, after: Position | None, limit: int) -> Page:
        self.threads.append(threading.current_thread().name)
        return super().fetch(after, limit)


def _started(tables: BinlogTables, *, ahead: bool = True, **changes: Any) -> tuple[Any, _ThreadsSeen, MemoryStateStore]:
    """A config, its source and a store holding the first tick's checkpoint (the binlog's end)."""
    config = dataclasses.replace(tables.config, **changes)
    source, store = _ThreadsSeen(config, ahead=ahead), MemoryStateStore("p")
    first = run_tick(config, source, store, RecordingSink(), owner_id="a")
    assert first.rows == 0 and store.load() is not None
    return config, source, store


def _backlog(tables: BinlogTables) -> list[int]:
    """Six pages of 50 in three transactions, then one-row commits: the ids, in binlog order."""
    for first in (1, 101, 201):
        tables.insert(list(range(first, first + 100)))
    for i in range(301, 311):
        tables.insert([i])
    return list(range(1, 311))


def _ids(sink: RecordingSink) -> list[int]:
    return [e.pk["id"] for b in sink.accepted for e in b.events]


def test_pages_after_the_first_are_decoded_on_the_reader_thread_and_sent_in_order(tables: BinlogTables) -> None:
    # Given a backlog of seven pages and pipelined commits (the default max_uncommitted_batches)
    config, source, store = _started(tables)
    expected = _backlog(tables)
    source.threads.clear()
    opened, sink = source.streams_opened, RecordingSink()
    # When one tick drains it
    result = run_tick(config, source, store, sink, owner_id="a")
    # Then the first page was read on the tick's thread and the next ones on the reader thread
    assert result.stop_reason == "caught_up" and result.rows == len(expected)
    assert source.threads[0] == threading.current_thread().name
    assert set(source.threads[1:]) == {"prefetch-p"}
    # And every change was sent once, in binlog order, from one stream, closed when the tick ended
    assert _ids(sink) == expected
    assert source.streams_opened == opened + 1 and source._reader is None


def test_with_strict_order_the_tick_reads_every_page_itself(tables: BinlogTables) -> None:
    # Given a backlog and max_uncommitted_batches = 1 (no page sent ahead of its checkpoint)
    config, source, store = _started(tables, max_uncommitted_batches=1)
    expected = _backlog(tables)
    source.threads.clear()
    sink = RecordingSink()
    # When one tick drains it
    run_tick(config, source, store, sink, owner_id="a")
    # Then no reader thread read a page, and every change was sent in order
    assert set(source.threads) == {threading.current_thread().name}
    assert _ids(sink) == expected


def test_a_send_that_fails_while_the_reader_is_ahead_loses_nothing(tables: BinlogTables) -> None:
    # Given a backlog, and a broker that fails the third batch of the first tick
    config, source, store = _started(tables)
    expected = _backlog(tables)
    sink = RecordingSink()
    sends = iter(range(1_000))

    def fail_third(_batch: Batch) -> None:
        if next(sends) == 2:
            raise EnqueueError("broker refused the batch (injected)")

    sink.before_accept = fail_third
    # When the tick fails there, with the reader a page or two ahead
    with pytest.raises(EnqueueError):
        run_tick(config, source, store, sink, owner_id="a")
    assert len(_ids(sink)) == 100
    # Then the next ticks deliver every change, in order, none twice
    drain(config, source, store, sink, owner_id="a")
    assert _ids(sink) == expected


def test_a_tick_that_stops_at_its_page_limit_sends_the_rest_next_tick_once(tables: BinlogTables) -> None:
    # Given a backlog and ticks of two pages
    config, source, store = _started(tables, max_batches_per_tick=2)
    expected = _backlog(tables)
    sink = RecordingSink()
    # When the ticks drain it
    first = run_tick(config, source, store, sink, owner_id="a")
    assert (first.stop_reason, first.rows) == ("max_batches", 100)
    drain(config, source, store, sink, owner_id="a")
    # Then every change is sent exactly once, in order
    assert _ids(sink) == expected


def test_a_stream_ahead_of_the_checkpoint_reads_again_from_it_within_the_tick(tables: BinlogTables) -> None:
    # Given a tick whose reader thread read two pages (its pin nested in the tick's)
    _config, source, store = _started(tables)
    _backlog(tables)
    snap = store.load()
    assert snap is not None
    start = snap.doc.checkpoint.position
    assert start is not None
    with source.pinned():
        first = source.fetch(start, 50)
        ahead: list[Page] = []

        def read_ahead() -> None:
            with source.pinned():
                page = source.fetch(first.end, 50)
                ahead.extend([page, source.fetch(page.end, 50)])

        reader = threading.Thread(target=read_ahead)
        reader.start()
        reader.join(30)
        assert not reader.is_alive() and len(ahead) == 2
        # the reader's pin ended, the tick's did not: the stream is still open
        assert source._reader is not None
        # When the tick sent only the first page, and its next drain reads from that checkpoint
        again = source.fetch(first.end, 50)
    # Then it gets the second page again (the third was read ahead and dropped), nothing skipped
    assert [r.values["id"] for r in again.rows] == [r.values["id"] for r in ahead[0].rows] == list(range(51, 101))
    assert again.end == ahead[0].end
    # And the stream closed with the tick's pin
    assert source._reader is None


def test_a_lingering_tick_reads_its_drains_from_one_stream(tables: BinlogTables) -> None:
    # Given a tick that lingers, and rows committed after its drain read its last page
    config, source, store = _started(tables, linger_seconds=1.5, poll_interval_ms=20)
    expected = _backlog(tables)
    opened, sink = source.streams_opened, RecordingSink()
    late = list(range(1001, 1101))
    committed = threading.Event()

    def commit_late(batch: Batch) -> None:  # while the drain's last (short) page is sent
        if not committed.is_set() and any(e.pk["id"] == expected[-1] for e in batch.events):
            committed.set()
            tables.insert(late)

    sink.before_accept = commit_late
    # When the tick drains the backlog, then lingers
    run_tick(config, source, store, sink, owner_id="a")
    # Then both arrived in order, the late ones in a later drain, and the reader thread's end did
    # not close the tick's stream: one stream for the tick
    assert committed.is_set() and _ids(sink) == expected + late
    assert source.streams_opened == opened + 1


def test_no_page_is_read_ahead_while_a_snapshot_runs(tables: BinlogTables) -> None:
    # Given pages whose positions carry a running snapshot, a finished one, none
    source = MysqlBinlogSource(tables.config)
    running = SnapshotState("s", (tables.qualified,), 100)
    finished = dataclasses.replace(running, tables=())
    at = Position(1, {"seq": 0}, None)

    def page(state: SnapshotState | None) -> Page:
        return Page([], advance=Position(at.cursor, at.pk, state))

    # Then only a running snapshot hands the reading back to the tick's thread
    assert source.reads_on(page(running)) is False
    assert source.reads_on(page(finished)) is True
    assert source.reads_on(page(None)) is True


def test_the_source_itself_reads_in_turn(tables: BinlogTables) -> None:
    # Given the source as shipped and a backlog of several pages
    config = tables.config
    source, store = MysqlBinlogSource(config), MemoryStateStore("p")
    run_tick(config, source, store, RecordingSink(), owner_id="a")
    expected, sink = _backlog(tables), RecordingSink()
    fetched_on: set[str] = set()
    fetch = source.fetch

    def noting(after: Position | None, limit: int) -> Page:
        fetched_on.add(threading.current_thread().name)
        return fetch(after, limit)

    source.fetch = noting  # type: ignore[method-assign]
    # When a tick drains it
    run_tick(config, source, store, sink, owner_id="a")
    # Then every page was read on the tick's thread (read-ahead is off: measured no faster), in order
    assert source.prefetch_pages is False and fetched_on == {threading.current_thread().name}
    assert _ids(sink) == expected

"""kind = "pg_logical" read ahead (issue 41): the slot is peeked and decoded on a reader thread
while the tick sends the previous pages, and the checkpoint and the slot still move only after
the hand-off landed, in commit order (poller.sources.pg_logical.ahead, poller.tick.prefetch).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import replace

import pytest

from poller.ports import Page
from poller.sources.pg_logical.source import PgLogicalSource
from poller.state.memory import MemoryStateStore
from poller.tick.lifecycle import run_tick
from shared.errors import EnqueueError
from shared.models import Batch, Lsn, Position
from tests.poller.pg_logical_support import LogicalTable, events_of, logical_table
from tests.poller.tick_support import RecordingSink, drain

pytestmark = pytest.mark.integration


@pytest.fixture
def logical(pg_logical_url: str) -> Iterator[LogicalTable]:
    with logical_table(pg_logical_url) as table:
        yield table


class _ThreadsSeen(PgLogicalSource):
    """The real source, noting which thread read each page."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.threads: list[str] = []

    def fetch(self, after: Position | None, limit: int) -> Page:
        self.threads.append(threading.current_thread().name)
        return super().fetch(after, limit)


def _backlog(logical: LogicalTable) -> list[int]:
    """Six pages of 50 in three transactions, then single-row commits: the ids, in commit order."""
    for first in (1, 101, 201):
        logical.insert(range(first, first + 100))
    for i in range(301, 311):
        logical.insert([i])
    return list(range(1, 311))


def _checkpoint_lsn(store: MemoryStateStore) -> Lsn:
    snap = store.load()
    assert snap is not None and snap.doc.checkpoint.position is not None
    cursor = snap.doc.checkpoint.position.cursor
    assert isinstance(cursor, Lsn)
    return cursor


def test_pages_after_the_first_are_decoded_on_the_reader_thread_and_sent_in_order(logical: LogicalTable) -> None:
    # Given a backlog of seven pages and pipelined commits (the default max_uncommitted_batches)
    expected = _backlog(logical)
    store, sink = MemoryStateStore("p"), RecordingSink()
    source = _ThreadsSeen(logical.config)
    # When one tick drains it
    result = run_tick(logical.config, source, store, sink, owner_id="a")
    # Then the first page was read on the tick's thread and the next ones on the reader thread
    assert result.stop_reason == "caught_up" and result.rows == len(expected)
    assert source.threads[0] == threading.current_thread().name
    assert set(source.threads[1:]) == {"prefetch-p"}
    # And every change was sent once, in commit order, and the slot follows the landed checkpoint
    assert [e.pk["id"] for b in sink.accepted for e in b.events] == expected
    assert logical.confirmed_flush() >= _checkpoint_lsn(store)


def test_a_tick_that_stops_early_drops_the_page_read_ahead_and_the_next_tick_sends_it(logical: LogicalTable) -> None:
    # Given a backlog and ticks of two pages (the reader has read a third when the tick stops)
    expected = _backlog(logical)
    config = replace(logical.config, max_batches_per_tick=2)
    store, sink = MemoryStateStore("p"), RecordingSink()
    source = PgLogicalSource(config)
    # When the first tick ends at its page limit
    first = run_tick(config, source, store, sink, owner_id="a")
    # Then it sent two pages (the first transaction: the slot may pass it, no further)
    assert (first.stop_reason, first.rows) == ("max_batches", 100)
    # And the next ticks send the rest: every change exactly once (a page read ahead is never sent)
    drain(config, source, store, sink, owner_id="a")
    assert [e.pk["id"] for b in sink.accepted for e in b.events] == expected


def test_a_send_that_fails_while_the_reader_is_ahead_loses_nothing(logical: LogicalTable) -> None:
    # Given a backlog, and a broker that fails the third batch of the first tick
    expected = _backlog(logical)
    store, sink = MemoryStateStore("p"), RecordingSink()
    source = PgLogicalSource(logical.config)
    sends = iter(range(1_000))

    def fail_third(_batch: Batch) -> None:
        if next(sends) == 2:
            raise EnqueueError("broker refused the batch (injected)")

    sink.before_accept = fail_third
    # When the tick fails there, with the reader a page or two ahead
    with pytest.raises(EnqueueError):
        run_tick(logical.config, source, store, sink, owner_id="a")
    # Then the slot is not past the first change that was not accepted
    accepted, slot = sum(len(b.events) for b in sink.accepted), logical.confirmed_flush()
    # And the next ticks deliver every change, in order, none twice
    drain(logical.config, source, store, sink, owner_id="a")
    events = events_of(sink.accepted)
    assert [e.pk["id"] for e in events] == expected
    assert sum(len(b.events) for b in sink.accepted) == len(expected)
    first_unsent = events[accepted].cursor
    assert isinstance(first_unsent, tuple) and isinstance(first_unsent[0], Lsn) and slot < first_unsent[0]


def test_the_slot_follows_landed_checkpoints_within_a_tick_so_a_peek_decodes_no_sent_change_again(
    logical: LogicalTable,
) -> None:
    # Given 1,500 one-row transactions: a tick of 20 pages of 50 peeks the slot several times
    with logical.engine.connect() as conn:
        for i in range(1, 1501):
            conn.exec_driver_sql(f"INSERT INTO {logical.name} (id, v, n) VALUES ({i}, 'x', 0)")
            conn.commit()
    store, sink = MemoryStateStore("p"), RecordingSink()
    source = PgLogicalSource(logical.config)
    slot_at_sends: list[Lsn] = []
    sink.before_accept = lambda _batch: slot_at_sends.append(logical.confirmed_flush())
    # When one tick sends them
    result = run_tick(logical.config, source, store, sink, owner_id="a")
    # Then the slot moved while the tick ran (to checkpoints that had landed), never past the last one
    assert result.rows == 1000
    assert slot_at_sends[-1] > slot_at_sends[0]
    assert max(slot_at_sends) <= _checkpoint_lsn(store)
    # And the next ticks send the rest: every change once, in commit order
    drain(logical.config, source, store, sink, owner_id="a")
    assert [e.pk["id"] for b in sink.accepted for e in b.events] == list(range(1, 1501))


def test_a_drain_that_goes_on_from_behind_pages_read_ahead_and_dropped_reads_them_again(
    logical: LogicalTable,
) -> None:
    # Given a lingering tick's pinned source: page A sent, page B read ahead (the end of the peek),
    # then, after new commits, page C peeked and decoded after B's end (the reader's position)
    config = replace(logical.config, batch_size=10)
    logical.insert(range(1, 11))
    logical.insert(range(11, 21))
    source = PgLogicalSource(config)
    try:
        with source.pinned():
            a = source.fetch(None, 10)
            b = source.fetch(a.end, 10)
            logical.insert(range(21, 31))
            c = source.fetch(b.end, 10)
            # When the drain stops with B and C unsent and the next drain goes on from A's landed checkpoint
            again = source.fetch(a.end, 10)
    finally:
        source.close()
    # Then it reads B again (main: C's buffer, decoded after B's end, gave C: B was never sent and
    # the checkpoint passed it — a page lost at every such drain end under load)
    ids = [[row.values["id"] for row in page.rows] for page in (a, b, c, again)]
    assert ids == [list(range(1, 11)), list(range(11, 21)), list(range(21, 31)), list(range(11, 21))]

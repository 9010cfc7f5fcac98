"""Linger (opt-in ``linger_seconds``): a tick that caught up keeps polling and sends what appears.

Source: SQLite (a file, WAL: the writer and the lingering reader do not block each other);
state: the in-memory store (the lease logic is covered elsewhere); sink: a recording sink.
"""

from __future__ import annotations

import datetime as dt
import itertools
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from azure.functions.timer import TimerRequest

from dbfanout.ops.notify import create_notify_triggers, drop_notify_triggers, missing_notify_triggers
from poller.functions import next_occurrence
from poller.lease.keeper import StickyLease
from poller.sources.factory import open_source
from poller.sources.keyset.source import SqlSource
from poller.state.memory import MemoryStateStore
from poller.tick.lifecycle import LINGER_MARGIN, TickResult, run_tick
from poller.tick.wake import NotifyWaker, notify_trigger_name
from shared.config import PollerConfig
from tests.poller.outbox_support import Outbox, outbox_poller
from tests.poller.pg_logical_support import logical_table
from tests.poller.source_fixtures import poller_config
from tests.poller.tick_support import RecordingSink, SourceTable, make_poller
from tests.support.databases import unique_name
from tests.support.ports import wait_until


@pytest.fixture
def table(tmp_path: Path) -> SourceTable:
    t = SourceTable(f"sqlite:///{tmp_path / 'linger.db'}")
    with t.engine.begin() as conn:
        conn.exec_driver_sql("PRAGMA journal_mode=WAL")
    return t


def _poller(table: SourceTable, **changes: Any) -> PollerConfig:
    return make_poller(str(table.engine.url), **{"linger_seconds": 3.0, "poll_interval_ms": 50, **changes})


class Background:
    """One tick on its own thread, so the test can write while it lingers."""

    def __init__(self, fn: Any) -> None:
        self.result: TickResult | None = None
        self.error: BaseException | None = None
        self.started = time.monotonic()
        self.ended: float | None = None
        self._thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self._thread.start()

    def _run(self, fn: Any) -> None:
        try:
            self.result = fn()
        except BaseException as exc:  # handed to the test
            self.error = exc
        finally:
            self.ended = time.monotonic()

    def join(self, timeout: float) -> TickResult:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the tick did not end"
        if self.error is not None:
            raise self.error
        assert self.result is not None
        return self.result

    @property
    def running(self) -> bool:
        return self._thread.is_alive()


@pytest.fixture
def queries(table: SourceTable) -> Iterator[list[float]]:
    """When each SELECT on the source table ran (counted at the SQLAlchemy engine of the poller)."""
    seen: list[float] = []

    def record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if statement.lstrip().upper().startswith("SELECT") and table.table in statement:
            seen.append(time.monotonic())

    sa.event.listen(sa.engine.Engine, "before_cursor_execute", record)
    try:
        yield seen
    finally:
        sa.event.remove(sa.engine.Engine, "before_cursor_execute", record)


def test_a_row_inserted_mid_linger_is_sent_without_waiting_for_the_next_timer(table: SourceTable) -> None:
    # Given a lingering poller that caught up with rows 0-2
    table.upsert(range(3))
    poller = _poller(table)
    source, sink, store = SqlSource(poller), RecordingSink(), MemoryStateStore(poller.name)
    tick = Background(lambda: run_tick(poller, source, store, sink, owner_id="A"))
    wait_until(lambda: len(sink.delivered()) == 3, 5, "the first rows")
    # When a row is inserted while the tick lingers
    table.upsert([3])
    inserted = time.monotonic()
    # Then the same tick sends it within a few poll intervals, long before it ends
    wait_until(lambda: len(sink.delivered()) == 4, 2, "the row inserted mid-linger")
    assert tick.running
    assert time.monotonic() - inserted < 1.0
    result = tick.join(10)
    assert result.rows == 4 and result.stop_reason == "caught_up"
    # And the checkpoint covers it: the next tick has nothing to send
    stored = store.load()
    assert stored is not None and stored.doc.checkpoint.position is not None
    assert stored.doc.checkpoint.position.pk == {"id": 3}


def test_a_linger_ends_before_the_next_timer_occurrence(table: SourceTable) -> None:
    # Given a poller allowed to linger far longer than the schedule leaves room for
    poller = _poller(table, linger_seconds=30.0)
    source, sink, store = SqlSource(poller), RecordingSink(), MemoryStateStore(poller.name)
    next_occurrence = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=1.5)
    # When a tick runs with the timer's next occurrence 1.5 s away
    started = time.monotonic()
    result = run_tick(poller, source, store, sink, owner_id="A", next_occurrence=next_occurrence)
    took = time.monotonic() - started
    ended_at = dt.datetime.now(dt.UTC)
    # Then it lingered (it did not return at once) and ended before the occurrence, with the margin
    assert result.stop_reason == "caught_up"
    assert took > 1.0
    assert ended_at < next_occurrence  # it aims LINGER_MARGIN earlier; one last poll may run past that
    assert ended_at > next_occurrence - dt.timedelta(seconds=LINGER_MARGIN + 0.3)  # and used the time it had


def test_a_linger_follows_a_drain_cut_at_max_batches_per_tick_and_drains_the_rest_at_once(table: SourceTable) -> None:
    # Given 100 rows and a lingering poller that sends at most 2 pages of 10 per drain, polling every second
    table.upsert(range(100))
    poller = _poller(table, max_batches_per_tick=2, linger_seconds=1.0, poll_interval_ms=1000)
    sent_at: list[float] = []
    source, store = SqlSource(poller), MemoryStateStore(poller.name)
    sink = RecordingSink(before_accept=lambda batch: sent_at.append(time.monotonic()))
    # When one tick runs
    result = run_tick(poller, source, store, sink, owner_id="A")
    # Then it does not stop at its first 20 rows and leave the rest to the next timer: it lingers
    assert result.rows == 100 and len(sink.delivered()) == 100
    # And a drain cut at max_batches_per_tick is followed at once, not after a poll interval
    # (a snapshot's chunks or a backlog would otherwise hold a live change up for a second each)
    assert len(sent_at) == 10
    assert sent_at[-1] - sent_at[0] < 0.9, [round(b - a, 3) for a, b in itertools.pairwise(sent_at)]


def test_a_drain_of_a_lingering_tick_stops_at_the_linger_s_end_not_at_the_next_timer(table: SourceTable) -> None:
    # Given a backlog of 500 pages, a send that takes 10 ms a page (5 s to drain it all), and the
    # timer's next occurrence 0.6 s away
    table.upsert(range(5000))
    poller = _poller(table, max_batches_per_tick=1000, linger_seconds=30.0)
    source, store = SqlSource(poller), MemoryStateStore(poller.name)
    sink = RecordingSink(before_accept=lambda batch: time.sleep(0.01))  # a slow transport, not a wait
    next_occurrence = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=0.6)
    # When a lingering tick runs
    result = run_tick(poller, source, store, sink, owner_id="A", next_occurrence=next_occurrence)
    ended_at = dt.datetime.now(dt.UTC)
    # Then it stops at the occurrence (aiming LINGER_MARGIN before it, so the host does not skip a
    # firing), the rest left for the next tick. The page in flight at the deadline still lands: on
    # a loaded machine (CI runs two suites on two cores) that page ran 0.36 s past it once, so the
    # bound allows half a second past, still far from the 5 s a drain of everything takes.
    assert 0 < result.rows < 5000 and result.stop_reason == "time_budget"
    assert ended_at < next_occurrence + dt.timedelta(seconds=0.5)


def test_an_idle_linger_backs_off_and_snaps_back_when_rows_appear(table: SourceTable, queries: list[float]) -> None:
    # Given a lingering poller (50 ms interval, backing off to 200 ms) with nothing to send
    poller = _poller(table, linger_seconds=2.5)
    sent_at: list[float] = []
    source, store = SqlSource(poller), MemoryStateStore(poller.name)
    sink = RecordingSink(before_accept=lambda batch: sent_at.append(time.monotonic()))
    tick = Background(lambda: run_tick(poller, source, store, sink, owner_id="A"))
    wait_until(lambda: time.monotonic() - tick.started > 1.5, 5, "the linger to back off")
    # When a row appears after 1.5 s of idling
    table.upsert([1])
    wait_until(lambda: len(sink.delivered()) == 1, 2, "the row")
    tick.join(10)
    # Then idle polls spread out (50, 100, 200, 200 ms...), far fewer than one per 50 ms
    gaps = [b - a for a, b in itertools.pairwise(queries)]
    assert 5 <= len(queries) <= 20, len(queries)
    assert max(gaps) >= 0.18
    # And the poll after the one that found the row came one base interval later, not a backed-off one
    found = max(i for i, q in enumerate(queries) if q <= sent_at[0])
    assert found + 1 < len(queries), "no poll after the row"
    assert queries[found + 1] - queries[found] < 0.15, gaps  # 50 ms and the row's send, not 200 ms


def test_the_background_renewal_keeps_the_lease_through_a_linger_longer_than_the_ttl(table: SourceTable) -> None:
    # Given a lease of 3 s and a linger of 4.5 s, under a kept (sticky) lease
    poller = replace(_poller(table, linger_seconds=4.5), lease_ttl_seconds=3)
    source, sink, store = SqlSource(poller), RecordingSink(), MemoryStateStore(poller.name)
    lease = StickyLease(store, "A", dt.timedelta(seconds=3), source.fingerprint)
    tick = Background(lambda: run_tick(poller, source, store, sink, owner_id="A", lease=lease))
    # When another owner tries while the tick lingers past the TTL
    wait_until(lambda: time.monotonic() - tick.started > 3.5, 10, "the linger to outlast the TTL")
    assert tick.running
    taken = store.peer().try_acquire("B", dt.timedelta(seconds=3), source.fingerprint)
    # Then the lease is still A's: the renewer extended it
    assert taken is None
    table.upsert([1])
    result = tick.join(10)
    assert result.rows == 1 and result.stop_reason == "caught_up"


# --------------------------------------------------------------------------------------------
# Every source kind on PostgreSQL: keyset with the xid horizon, outbox, pg_logical


@dataclass
class Kind:
    """A source of one kind on a fresh PostgreSQL table: its config, a writer, and cleanup."""

    poller: PollerConfig
    write: Callable[[int], None]
    close: Callable[[], None]


def _keyset_xid(pg_url: str) -> Kind:
    engine = sa.create_engine(pg_url)
    name = unique_name("lkx")
    with engine.begin() as conn:
        conn.exec_driver_sql(
            f"CREATE TABLE {name} (id bigint PRIMARY KEY, c timestamptz NOT NULL DEFAULT clock_timestamp(), "
            "txid xid8 NOT NULL DEFAULT pg_current_xact_id())"
        )

    def write(i: int) -> None:
        with engine.begin() as conn:
            conn.exec_driver_sql(f"INSERT INTO {name} (id) VALUES ({i})")

    def close() -> None:
        with engine.begin() as conn:
            conn.exec_driver_sql(f"DROP TABLE {name}")
        engine.dispose()

    poller = poller_config(pg_url, table=name, xid_column="txid", linger_seconds=5.0, poll_interval_ms=50)
    return Kind(poller, write, close)


def _outbox(pg_url: str) -> Kind:
    box = Outbox(pg_url)
    poller = outbox_poller(pg_url, box.name, linger_seconds=5.0, poll_interval_ms=50)
    return Kind(poller, lambda i: box.write(str(i), "created", {"id": i}), box.drop)


@pytest.fixture(params=["keyset-xid", "outbox", "pg_logical"])
def kind(request: pytest.FixtureRequest, pg_url: str) -> Iterator[Kind]:
    if request.param == "pg_logical":  # the logical server only for this kind (a private one may start)
        with logical_table(request.getfixturevalue("pg_logical_url")) as table:
            poller = replace(table.config, linger_seconds=5.0, poll_interval_ms=50)
            yield Kind(poller, lambda i: table.insert([i]), lambda: None)
        return
    made = _keyset_xid(pg_url) if request.param == "keyset-xid" else _outbox(pg_url)
    try:
        yield made
    finally:
        made.close()


@pytest.mark.integration
def test_every_postgresql_source_kind_sends_a_change_made_mid_linger(kind: Kind) -> None:
    # Given a lingering tick of this kind that found nothing to send
    source, sink = open_source(kind.poller), RecordingSink()
    store = MemoryStateStore(kind.poller.name)
    queried = threading.Event()

    def seen(*args: Any) -> None:
        queried.set()

    sa.event.listen(sa.engine.Engine, "before_cursor_execute", seen)
    try:
        tick = Background(lambda: run_tick(kind.poller, source, store, sink, owner_id="A"))
        wait_until(queried.is_set, 10, "the tick's first poll")
    finally:
        sa.event.remove(sa.engine.Engine, "before_cursor_execute", seen)
    # When a change commits while it lingers
    kind.write(1)
    # Then the same tick sends it (the xid horizon may hold it back while other sessions run)
    wait_until(lambda: len(sink.accepted) > 0 or not tick.running, 6, "the change to be sent")
    assert tick.running, "the tick ended before the change arrived"
    result = tick.join(15)
    assert result.rows == 1
    source.close()


def test_the_timer_function_reads_the_next_occurrence_from_the_schedule_status() -> None:
    # Given timer requests as the Functions host fills them (with and without use_monitor)
    due = "2026-04-07T01:23:45+00:00"
    with_status = TimerRequest(schedule_status={"Last": due, "Next": due, "LastUpdated": due})
    naive = TimerRequest(schedule_status={"Next": "2026-04-07T01:23:45"})
    # Then the next occurrence is known when the status carries it (naive times are UTC), else None
    assert next_occurrence(with_status) == dt.datetime(2026, 4, 7, 1, 23, 45, tzinfo=dt.UTC)
    assert next_occurrence(naive) == dt.datetime(2026, 4, 7, 1, 23, 45, tzinfo=dt.UTC)
    assert next_occurrence(TimerRequest()) is None
    assert next_occurrence(TimerRequest(schedule_status={"Next": "soon"})) is None


# --------------------------------------------------------------------------------------------
# wake = "notify" (PostgreSQL)


@pytest.mark.integration
def test_notify_wakes_a_lingering_tick_at_a_commit_and_an_idle_linger_sends_no_query(pg_url: str) -> None:
    # Given a keyset poller with wake = "notify", a poll interval far longer than the test's bounds,
    # and its trigger created as validate --fix creates it
    made = _keyset_xid(pg_url)
    poller = replace(made.poller, wake="notify", poll_interval_ms=5000, linger_seconds=4.0)
    assert create_notify_triggers(poller) == [f"trigger {notify_trigger_name(poller)} on {poller.table}"]
    assert missing_notify_triggers(poller) == []
    source, sink, store = open_source(poller), RecordingSink(), MemoryStateStore(poller.name)
    waker = NotifyWaker(poller)
    selects: list[float] = []

    def record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if statement.lstrip().upper().startswith("SELECT") and str(poller.table) in statement:
            selects.append(time.monotonic())

    sa.event.listen(sa.engine.Engine, "before_cursor_execute", record)
    try:
        tick = Background(lambda: run_tick(poller, source, store, sink, owner_id="A", waker=waker))
        wait_until(lambda: selects, 10, "the tick's first fetch")
        # When it idles for a second, Then it sends no query (it waits on LISTEN)
        idle_from = time.monotonic()
        wait_until(lambda: time.monotonic() - idle_from > 1.0, 5, "an idle second")
        assert [t for t in selects if t > idle_from] == []
        # When a row commits, Then the same tick sends it at once (not after the 5 s interval)
        made.write(1)
        committed = time.monotonic()
        wait_until(lambda: len(sink.accepted) == 1, 3, "the notified change")
        assert time.monotonic() - committed < 1.0
        assert tick.join(10).rows == 1
    finally:
        sa.event.remove(sa.engine.Engine, "before_cursor_execute", record)
        waker.close()
        source.close()
        # And `dbfanout notify drop` removes the trigger again
        assert drop_notify_triggers(poller) == [f"trigger {notify_trigger_name(poller)} on {poller.table}"]
        assert missing_notify_triggers(poller) == [poller.table]
        made.close()

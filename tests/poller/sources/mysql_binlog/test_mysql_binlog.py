"""kind = "mysql_binlog": every change from the row-based binlog, through the real tick (MariaDB).

The server is the ``mysql_binlog_url`` fixture's: the shared test server when its binlog is on
with ROW format, else a private ``mariadbd`` started for the session (tests/support/private_mariadb.py).
Each test has its own tables (dropped even on failure); the state store is the in-memory fake.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

import poller.sources.mysql_binlog.source as mysql_binlog
from poller.sources.mysql_binlog.position import BinlogPosition
from poller.sources.mysql_binlog.reader import BinlogReader
from poller.sources.mysql_binlog.source import MysqlBinlogSource
from poller.state.memory import MemoryStateStore
from poller.tick.events import page_batch
from shared.errors import SourceError
from shared.models import Position, RowChange
from tests.poller.mysql_binlog_support import BinlogTables, binlog_tables, events_of
from tests.poller.tick_support import RecordingSink, drain

pytestmark = pytest.mark.integration


@pytest.fixture
def tables(mysql_binlog_url: str) -> Iterator[BinlogTables]:
    with binlog_tables(mysql_binlog_url) as made:
        yield made


def _started(tables: BinlogTables, **changes: Any) -> tuple[MysqlBinlogSource, Position]:
    """A source and the checkpoint its first fetch sets (the binlog's end: changes after it are read)."""
    config = dataclasses.replace(tables.config, **changes)
    source = MysqlBinlogSource(config)
    first = source.fetch(None, 10)
    assert len(first) == 0 and first.advance is not None
    return source, first.advance


def _read(
    source: MysqlBinlogSource, after: Position, limit: int, *, pinned: bool = True
) -> tuple[list[RowChange], Position]:
    """Every change after ``after``, page by page (as one tick reads them when ``pinned``)."""
    events: list[RowChange] = []

    def pages() -> Position:
        nonlocal after
        while True:
            page = source.fetch(after, limit)
            if len(page):
                events.extend(page_batch(source_config(source), source.fingerprint, page).events)
            if page.end is not None:
                after = page.end
            if len(page) < limit:
                return after

    if pinned:
        with source.pinned():
            return events, pages()
    return events, pages()


def source_config(source: MysqlBinlogSource) -> Any:
    return source._config


def _summary(events: list[RowChange]) -> list[tuple[Any, ...]]:
    return [(e.change, e.table.rpartition(".")[2] if e.table else None, *e.pk.values()) for e in events]


def test_inserts_updates_and_hard_deletes_arrive_in_commit_order_with_both_images(tables: BinlogTables) -> None:
    # Given a poller that has taken its starting point
    source, start = _started(tables)
    t, c = tables.name, tables.composite
    # When rows are inserted, updated (one changes its key), deleted, across both tables,
    # and a transaction is rolled back
    tables.sql("INSERT INTO {t} (id, v, n) VALUES (1, 'a', 0), (2, 'a', 0)", "INSERT INTO {c} VALUES (1, 'x', 'a')")
    tables.sql("UPDATE {t} SET v = 'b', n = 1 WHERE id = 1", "UPDATE {c} SET b = 'y' WHERE a = 1")
    with tables.engine.connect() as conn:
        conn.execute(sa.text(f"INSERT INTO {t} (id, v, n) VALUES (99, 'rolled back', 0)"))
        conn.rollback()
    tables.sql("UPDATE {t} SET id = 3 WHERE id = 2")
    tables.sql("DELETE FROM {t} WHERE id = 1", "DELETE FROM {c}")
    events, _ = _read(source, start, 3)
    # Then each change arrives once, in commit order, with its images and its qualified table
    assert _summary(events) == [
        ("insert", t, 1), ("insert", t, 2), ("insert", c, 1, "x"),
        ("update", t, 1), ("update", c, 1, "y"),
        ("update", t, 3),
        ("delete", t, 1), ("delete", c, 1, "y"),
    ]  # fmt: skip
    update = events[3]
    assert update.before == {"id": 1, "v": "a", "n": 0} and update.after == {"id": 1, "v": "b", "n": 1}
    key_change = events[5]
    assert key_change.before is not None and key_change.before["id"] == 2 and key_change.pk == {"id": 3}
    delete = events[6]
    assert (delete.op, delete.after, delete.before) == ("delete", None, {"id": 1, "v": "b", "n": 1})
    assert {e.table for e in events} == {tables.qualified, f"{tables.database}.{c}"}
    assert all(e.committed_at is not None for e in events)


def test_a_large_transaction_spans_pages_and_fresh_streams_with_the_same_ids(tables: BinlogTables) -> None:
    # Given one transaction of 120 rows between two small ones
    source, start = _started(tables)
    tables.insert([1000])
    tables.insert(list(range(1, 121)))
    tables.insert([2000])
    # When it is read in pages of 7 in one tick (one stream), and again with a new stream per page
    # (as ticks that each read one page do: each resumes inside the transaction by its seq)
    one, end = _read(source, start, 7)
    fresh, end_fresh = _read(MysqlBinlogSource(tables.config), start, 7, pinned=False)
    # Then both deliver every row once, in order, with the same event ids and end
    assert [e.pk["id"] for e in one] == [1000, *range(1, 121), 2000]
    assert [e.event_id for e in fresh] == [e.event_id for e in one]
    assert end_fresh == end
    # and nothing is delivered again from the end
    assert _read(source, end, 7)[0] == []


def test_a_backlog_of_several_hundred_kilobytes_is_read_whole_page_by_page(tables: BinlogTables) -> None:
    # Given a backlog of 5000 changes (~400 KB of binlog: a non-blocking dump sends it all and the
    # server drops the connection while the client still decodes what it buffered)
    source, start = _started(tables)
    for first in range(0, 4000, 1000):
        tables.insert(list(range(first, first + 1000)))
    tables.sql("UPDATE {t} SET n = n + 1 WHERE id < 1000")
    # When one tick reads it in pages of 1000
    events, _ = _read(source, start, 1000)
    # Then every change arrives once, in order, from one stream
    assert [(e.change, e.pk["id"]) for e in events] == [("insert", i) for i in range(4000)] + [
        ("update", i) for i in range(1000)
    ]
    assert source.streams_opened == 1


def test_a_checkpoint_inside_a_transaction_resumes_after_its_row_never_before(tables: BinlogTables) -> None:
    # Given a transaction of 10 rows and a checkpoint at its 4th row
    source, start = _started(tables)
    tables.insert(list(range(1, 11)))
    page = source.fetch(start, 4)
    source.close()
    assert [r.event.pk["id"] for r in page.rows if r.event] == [1, 2, 3, 4]
    checkpoint = page.end
    assert checkpoint is not None
    # When a new source (a restarted process) resumes from it
    events, _ = _read(MysqlBinlogSource(tables.config), checkpoint, 50)
    # Then rows 5..10 come, none of the first four again
    assert [e.pk["id"] for e in events] == list(range(5, 11))


@pytest.mark.parametrize("by_gtid", [True, False], ids=["gtid", "coordinates"])
def test_a_reader_resuming_from_a_position_does_not_resend_what_is_before_it(
    tables: BinlogTables, by_gtid: bool
) -> None:
    # Given transactions before and after a checkpoint in the same binlog file (the library's
    # default, resume_stream=False, starts a coordinates stream at the file's offset 4 and its
    # MariaDB mode ignores the file and offset: both re-send what is before the checkpoint)
    source, start = _started(tables)
    tables.insert([1, 2])
    tables.insert([3])
    tables.insert([4])
    page = source.fetch(start, 3)  # ends with the second transaction's row
    source.close()
    checkpoint = BinlogPosition.from_position(page.end)  # type: ignore[arg-type]
    assert checkpoint.seq == 0
    # When a reader resumes there, by GTID state (MariaDB) or by file and offset (MySQL's way)
    settings = _settings(tables.url)
    reader = BinlogReader(settings, 4243, frozenset({tables.qualified}), checkpoint, _end(tables), by_gtid=by_gtid)
    try:
        changes = reader.read(50)
    finally:
        reader.close()
    # Then only the rows after the checkpoint come
    assert [c.after["id"] for c in changes if c.after] == [4]


def test_a_dropped_replication_connection_does_not_resend_transactions(tables: BinlogTables) -> None:
    # Given transactions of the poller's table around 16 MB of another table's (the server sends
    # every table's events: the stream is still being sent while the reader has read a few rows)
    _, start = _started(tables)
    other = f"{tables.name}_bulk"
    tables.sql(f"CREATE TABLE {other} (id INT PRIMARY KEY, v LONGTEXT)")
    try:
        for first in range(0, 300, 3):
            tables.insert([first, first + 1, first + 2])
        for i in range(160):
            tables.sql(f"INSERT INTO {other} VALUES ({i}, REPEAT('x', 100000))")
        for first in range(300, 600, 3):
            tables.insert([first, first + 1, first + 2])
        checkpoint = BinlogPosition.from_position(start)
        until = _end(tables)
        tables_read = frozenset({tables.qualified})
        reader = BinlogReader(_settings(tables.url), 4244, tables_read, checkpoint, until, by_gtid=True)
        try:
            got = reader.read(5)
            # When the server drops the replication connection, the library reconnects by itself
            # from the GTID state the reader was opened with, and sends the first transactions again
            with tables.engine.connect() as conn:
                dumps = [r[0] for r in conn.execute(sa.text("SHOW PROCESSLIST")) if r[4] == "Binlog Dump"]
                assert dumps, "the replication stream ended before it could be dropped"
                for thread in dumps:
                    conn.execute(sa.text(f"KILL {int(thread)}"))
            got += reader.read(10_000)
        finally:
            reader.close()
        # Then it did restart, and no change came twice and none is missing
        assert reader.restarts >= 1
        assert [c.after["id"] for c in got if c.after] == list(range(600))
    finally:
        tables.sql(f"DROP TABLE {other}")


def test_columns_are_labelled_as_they_were_when_written_across_alter_table(tables: BinlogTables) -> None:
    # Given a poller that has taken its starting point
    source, start = _started(tables)
    t = tables.name
    # When the table is altered between writes (add, rename, change a type, drop), all before the
    # poller reads any of them
    tables.sql("INSERT INTO {t} (id, v, n) VALUES (1, 'a', 10)")
    tables.sql("ALTER TABLE {t} ADD COLUMN extra VARCHAR(10) DEFAULT 'e' AFTER id")
    tables.sql("INSERT INTO {t} (id, extra, v, n) VALUES (2, 'x', 'b', 20)")
    tables.sql("ALTER TABLE {t} RENAME COLUMN v TO label")
    tables.sql("INSERT INTO {t} (id, extra, label, n) VALUES (3, 'y', 'c', 30)")
    tables.sql("ALTER TABLE {t} MODIFY COLUMN n VARCHAR(20)")
    tables.sql("INSERT INTO {t} (id, extra, label, n) VALUES (4, 'z', 'd', 'forty')")
    tables.sql("ALTER TABLE {t} DROP COLUMN extra")
    tables.sql("UPDATE {t} SET label = 'e' WHERE id = 1")
    events, _ = _read(source, start, 50)
    # Then each change carries the columns its table had when it was written
    assert [e.after for e in events] == [
        {"id": 1, "v": "a", "n": 10},
        {"id": 2, "extra": "x", "v": "b", "n": 20},
        {"id": 3, "extra": "y", "label": "c", "n": 30},
        {"id": 4, "extra": "z", "label": "d", "n": "forty"},
        {"id": 1, "label": "e", "n": "10"},
    ]
    assert events[-1].before == {"id": 1, "label": "a", "n": "10"}
    assert {e.table for e in events} == {f"{tables.database}.{t}"}


def test_a_poller_delivers_only_changes_after_its_first_tick(tables: BinlogTables) -> None:
    # Given rows written before the poller's first tick
    tables.insert([1])
    store, sink = MemoryStateStore("p"), RecordingSink()
    source = MysqlBinlogSource(tables.config)
    drain(tables.config, source, store, sink)
    snap = store.load()
    assert snap is not None and snap.doc.checkpoint.position is not None  # the starting point is checkpointed
    # When more are written and the poller ticks
    tables.insert([2, 3])
    tables.sql("DELETE FROM {t} WHERE id = 1")
    drain(tables.config, source, store, sink)
    # Then the changes after its first tick arrive (the delete of an older row included)
    assert _summary(events_of(sink.accepted)) == [
        ("insert", tables.name, 2), ("insert", tables.name, 3), ("delete", tables.name, 1),
    ]  # fmt: skip


def test_an_idle_fetch_opens_no_replication_stream(tables: BinlogTables) -> None:
    # Given a poller that has read to the end of the binlog
    source, start = _started(tables)
    tables.insert([1])
    events, end = _read(source, start, 10)
    assert len(events) == 1
    opened = source.streams_opened
    # When it fetches again with nothing new: no stream is opened (one SHOW MASTER STATUS only)
    for _ in range(3):
        assert len(source.fetch(end, 10)) == 0
    assert source.streams_opened == opened
    # and when a change arrives, the next fetch opens one and reads it
    tables.insert([2])
    page = source.fetch(end, 10)
    assert [r.event.pk for r in page.rows if r.event] == [{"id": 2}]
    assert source.streams_opened == opened + 1


def test_within_a_tick_fetches_after_the_end_read_on_from_the_open_stream(tables: BinlogTables) -> None:
    # Given a tick (pinned) whose stream read to the end of the binlog
    source, start = _started(tables)
    tables.insert([1])
    with source.pinned():
        page = source.fetch(start, 10)
        assert len(page) == 1 and page.end is not None
        opened = source.streams_opened
        # When nothing is new, and then a change commits, as a lingering tick polls
        assert len(source.fetch(page.end, 10)) == 0
        tables.insert([2])
        more = source.fetch(page.end, 10)
        # Then the change is read from the same stream (no new replication connection)
        assert [r.event.pk for r in more.rows if r.event] == [{"id": 2}]
        assert source.streams_opened == opened
    # and the next tick (a new stream from its checkpoint) finds nothing again
    assert more.end is not None and len(source.fetch(more.end, 10)) == 0


def test_changes_on_both_sides_of_a_binlog_rotation_arrive_and_resume_across_files(tables: BinlogTables) -> None:
    # Given changes before and after the server starts a new binlog file
    source, start = _started(tables)
    tables.insert([1, 2])
    with tables.engine.connect() as conn:
        conn.execute(sa.text("FLUSH BINARY LOGS"))
    tables.insert([3])
    tables.sql("DELETE FROM {t} WHERE id = 1")
    # When one page ends in the first file and a new source resumes from there
    first = source.fetch(start, 2)
    source.close()
    assert first.end is not None
    rest, end = _read(MysqlBinlogSource(tables.config), first.end, 10)
    # Then everything arrives once, and the last position is in the new file
    assert [r.event.pk["id"] for r in first.rows if r.event] == [1, 2]
    assert [(e.change, e.pk["id"]) for e in rest] == [("insert", 3), ("delete", 1)]
    assert BinlogPosition.from_position(end).file_number > BinlogPosition.from_position(first.end).file_number


def test_other_tables_traffic_moves_the_checkpoint_without_rows(
    tables: BinlogTables, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a poller of a quiet table, and a busy table it does not read
    monkeypatch.setattr(mysql_binlog, "ADVANCE_BYTES", 4096)
    source, start = _started(tables)
    other = f"{tables.name}_other"
    tables.sql(f"CREATE TABLE {other} (id INT PRIMARY KEY, v VARCHAR(200))")
    try:
        for i in range(40):
            tables.sql(f"INSERT INTO {other} VALUES ({i}, REPEAT('x', 200))")
        # When it fetches
        page = source.fetch(start, 10)
        # Then no row comes, but the checkpoint may move past the other table's changes
        assert len(page) == 0 and page.advance is not None
        moved = BinlogPosition.from_position(page.advance)
        assert moved > BinlogPosition.from_position(start)
        # and a change of its own table after them is read from there
        tables.insert([7])
        assert [e.pk for e in _read(source, page.advance, 10)[0]] == [{"id": 7}]
    finally:
        tables.sql(f"DROP TABLE {other}")


def test_a_checkpoint_in_a_purged_binlog_is_an_error_naming_it(tables: BinlogTables) -> None:
    # Given a checkpoint in a binlog file older than the server's oldest
    source, start = _started(tables)
    here = BinlogPosition.from_position(start)
    gone = dataclasses.replace(here, file_number=0, file=here.file.rsplit(".", 1)[0] + ".000000")
    # When the poller fetches from it
    with pytest.raises(SourceError) as raised:
        source.fetch(gone.to_position(), 10)
    # Then it fails, naming the position and the fix, instead of skipping to the binlog's end
    text = f"{raised.value} {raised.value.hint}"
    assert "purged" in text and ".000000" in text and "checkpoint reset" in text


def test_a_gtid_state_the_server_does_not_have_is_an_error(tables: BinlogTables) -> None:
    # Given a checkpoint whose GTID state is ahead of anything the server wrote (another server's)
    source, start = _started(tables)
    here = BinlogPosition.from_position(start)
    if here.gtid_state is None:
        pytest.skip("the server has no GTIDs (MySQL with gtid_mode = OFF)")
    unknown = dataclasses.replace(here, gtid_state="0-1-999999999")
    # When the poller fetches from it, then it fails with the fix (never a silent skip)
    with pytest.raises(SourceError) as raised:
        source.fetch(unknown.to_position(), 10)
    assert "checkpoint reset" in str(raised.value.hint)


def test_the_binlog_end_of_a_new_source_is_not_before_what_was_committed(tables: BinlogTables) -> None:
    # Given a committed row, then a new poller's starting point
    tables.insert([1])
    source, start = _started(tables)
    # Then reading from the start finds nothing (the row is before it)
    assert _read(source, start, 10)[0] == []


def _end(tables: BinlogTables) -> tuple[str, int]:
    with tables.engine.connect() as conn:
        row = conn.execute(sa.text("SHOW MASTER STATUS")).one()
    return str(row[0]), int(row[1])


def _settings(url: str) -> dict[str, Any]:
    parsed = sa.make_url(url)
    return {"host": parsed.host, "port": parsed.port or 3306, "user": parsed.username,
            "password": parsed.password or ""}  # fmt: skip

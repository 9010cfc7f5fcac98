"""Snapshot chunks on MariaDB (poller/snapshot/mysql.py): keyset pages, ``where``, quoting, and the
barrier / watermark rows the binlog carries around a chunk's consistent snapshot.

The server is the ``mysql_binlog_url`` fixture's (a private ``mariadbd`` with the binlog on when
the shared one has it off). Each test has its own tables and signal table, dropped after.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from poller.snapshot.chunks import Chunk
from poller.snapshot.mysql import (
    MysqlChunkReader,
    mysql_request_statement,
    mysql_signal_sql,
    quote_mysql,
    row_version,
    signal_table,
)
from poller.snapshot.requests import apply_request, signal_of
from poller.snapshot.where import WhereRefused, where_sql
from shared.config import PollerConfig
from shared.errors import SourceError
from shared.models import SnapshotState
from tests.poller.mysql_binlog_support import BinlogTables, binlog_changes, binlog_here, binlog_tables
from tests.support.databases import unique_name

pytestmark = pytest.mark.integration

NOW = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)


@pytest.fixture
def tables(mysql_binlog_url: str) -> Iterator[BinlogTables]:
    with binlog_tables(mysql_binlog_url) as made:
        # A poller of its own and a signal table of its own: tests never read each other's signals.
        made.config = dataclasses.replace(
            made.config, name=unique_name("p"), signal_table=f"{made.database}.{made.name}_sig"
        )
        with made.engine.begin() as conn:
            for statement in mysql_signal_sql(made.config):
                conn.execute(sa.text(statement))
        try:
            yield made
        finally:
            with made.engine.begin() as conn:
                conn.execute(sa.text(f"DROP TABLE IF EXISTS {quote_mysql(signal_table(made.config))}"))


def _state(table: str, size: int, **more: Any) -> SnapshotState:
    return SnapshotState(id="run1", tables=(table,), chunk_size=size, started_at=NOW, **more)


def _all_chunks(reader: MysqlChunkReader, engine: sa.Engine, state: SnapshotState) -> list[Chunk]:
    """Read chunk after chunk as the coordinator does (the next from the last one's basis)."""
    chunks: list[Chunk] = []
    basis: SnapshotState | None = state
    with engine.connect() as conn:
        while basis is not None and len(chunks) < 100:
            chunk = reader.read(conn, basis, None)
            assert chunk is not None
            chunks.append(chunk)
            basis = chunk.next_basis()
    return chunks


# ------------------------------------------------------------------------------ where, rendered


def test_where_renders_backticks_and_binds_for_mysql_and_keeps_postgresql_output() -> None:
    columns = {"id", "Grp", "Odd`Name", "region"}
    # MySQL: backticks (a backtick in a name doubled), a column matched whatever its case, values bound
    sql, params = where_sql("grp = 'eu' AND `Odd``Name` >= 3 AND Region IN (\"a\", 'b')", columns, "mysql")
    assert sql == ("`Grp` = :dbfanout_w0 AND `Odd``Name` >= :dbfanout_w1 AND `region` IN (:dbfanout_w2, :dbfanout_w3)")
    assert params == {"dbfanout_w0": "eu", "dbfanout_w1": 3, "dbfanout_w2": "a", "dbfanout_w3": "b"}
    # PostgreSQL (the default) unchanged: double quotes, unquoted names folded to lower case
    assert where_sql('"Grp" = 1 AND region = 2', columns) == (
        '"Grp" = :dbfanout_w0 AND region = :dbfanout_w1',
        {"dbfanout_w0": 1, "dbfanout_w1": 2},
    )
    with pytest.raises(WhereRefused, match="unknown column 'grp'"):
        where_sql("grp = 1", columns)
    # what the grammar refuses it refuses on MySQL too
    for hostile in ("id = 1; DROP TABLE t", "id = (SELECT 1)", "SLEEP(5) = 0", "id = 1 -- x", "t.id = 1"):
        with pytest.raises(WhereRefused):
            where_sql(hostile, columns, "mysql")


# ------------------------------------------------------------------------------ chunks


def test_chunks_page_a_composite_key_table_completely_in_key_order(tables: BinlogTables) -> None:
    # Given a composite-key table of 23 rows, inserted out of key order
    keys = [(a, f"b{b}") for a in range(5) for b in range(5) if (a, b) not in ((1, 3), (4, 0))]
    rows = [{"a": a, "b": b, "v": f"v{a}{b}"} for a, b in reversed(keys)]
    with tables.engine.begin() as conn:
        conn.execute(sa.text(f"INSERT INTO {tables.composite} (a, b, v) VALUES (:a, :b, :v)"), rows)
    table = f"{tables.database}.{tables.composite}"
    reader = MysqlChunkReader(tables.config, tables.engine)
    assert reader.pk(table) == ("a", "b")
    assert reader.columns(table) == {"a", "b", "v"}
    # When it is read in chunks of 5
    chunks = _all_chunks(reader, tables.engine, _state(table, 5))
    # Then every row comes once, in key order; each chunk but the last says more follow
    assert [len(c.tuples) for c in chunks] == [5, 5, 5, 5, 3]
    assert [c.more for c in chunks] == [True, True, True, True, False]
    got = [c.key_of(t) for c in chunks for t in c.tuples]
    assert got == sorted(keys)
    assert chunks[0].names == ("a", "b", "v")
    # each tuple: the row's columns, its version, the flag (false), as PostgreSQL's reader shapes them
    first = chunks[0].tuples[0]
    assert first[:3] == (0, "b0", "v0b0") and first[3] == row_version(("a", "b", "v"), (0, "b0", "v0b0"))
    assert first[4] is False
    assert chunks[0].last_key == chunks[1].state.last_key == {"a": 0, "b": "b4"}  # the next starts after it
    # And a second read of the unchanged table gives every row the same version; a changed row a new one
    tables.sql("UPDATE {c} SET v = 'changed' WHERE a = 2 AND b = 'b2'")
    again = {c.key_of(t): t[3] for c in _all_chunks(reader, tables.engine, _state(table, 7)) for t in c.tuples}
    before = {c.key_of(t): t[3] for c in chunks for t in c.tuples}
    assert {k for k in keys if again[k] != before[k]} == {(2, "b2")}


def test_chunks_honour_where_and_the_chunk_limit(tables: BinlogTables) -> None:
    with tables.engine.begin() as conn:
        conn.execute(
            sa.text(f"INSERT INTO {tables.name} (id, v, n) VALUES (:id, :v, :n)"),
            [{"id": i, "v": "skip" if i % 5 == 0 else "keep", "n": i % 4} for i in range(1, 41)],
        )
    reader = MysqlChunkReader(tables.config, tables.engine)
    state = _state(tables.qualified, 4, where="n >= 2 AND v <> 'skip'")
    chunks = _all_chunks(reader, tables.engine, state)
    got = [t[0] for c in chunks for t in c.tuples]
    assert got == [i for i in range(1, 41) if i % 4 >= 2 and i % 5 != 0]
    # a smaller limit reads fewer rows this time (the next chunk goes on after them)
    with tables.engine.connect() as conn:
        chunk = reader.read(conn, state, None, limit=2)
    assert chunk is not None and [t[0] for t in chunk.tuples] == got[:2] and chunk.more
    # a condition over a column the table lacks is refused before anything runs
    with pytest.raises(WhereRefused, match="unknown column"):
        reader.check_where([tables.qualified], "nope = 1")
    reader.check_where([tables.qualified], "N BETWEEN 1 AND 2")  # MySQL's names match whatever their case


def test_awkward_names_are_quoted_and_the_exact_table_is_found(tables: BinlogTables) -> None:
    # Given a table whose name has upper case and a backtick, a key column with a backtick, and a
    # table of the same name in lower case (another table on a case-sensitive file system)
    odd, lower = f"{tables.name}_Mi`x", f"{tables.name}_mi`x"
    with tables.engine.begin() as conn:
        columns = "`K``ey` INT, `Grp` VARCHAR(10), PRIMARY KEY (`K``ey`)"
        conn.execute(sa.text(f"CREATE TABLE {quote_mysql(odd)} ({columns})"))
        conn.execute(sa.text(f"CREATE TABLE {quote_mysql(lower)} (other INT PRIMARY KEY)"))
        conn.execute(
            sa.text(f"INSERT INTO {quote_mysql(odd)} VALUES (:k, :g)"),
            [{"k": k, "g": "a" if k % 2 else "b"} for k in range(10)],
        )
    try:
        table = f"{tables.database}.{odd}"
        reader = MysqlChunkReader(tables.config, tables.engine)
        assert reader.pk(table) == ("K`ey",)
        assert reader.columns(table) == {"K`ey", "Grp"}
        assert reader.pk(f"{tables.database}.{lower}") == ("other",)
        chunks = _all_chunks(reader, tables.engine, _state(table, 3, where="grp = 'a' AND `K``ey` > 2"))
        assert [t[0] for c in chunks for t in c.tuples] == [3, 5, 7, 9]
        assert chunks[0].names == ("K`ey", "Grp")
    finally:
        with tables.engine.begin() as conn:
            conn.execute(sa.text(f"DROP TABLE {quote_mysql(odd)}, {quote_mysql(lower)}"))


def test_a_table_without_a_primary_key_is_refused_with_the_fix(tables: BinlogTables) -> None:
    with tables.engine.begin() as conn:
        conn.execute(sa.text(f"CREATE TABLE {tables.name}_nk (x INT)"))
    try:
        with pytest.raises(SourceError, match="no primary key") as raised:
            MysqlChunkReader(tables.config, tables.engine).pk(f"{tables.database}.{tables.name}_nk")
        assert raised.value.hint is not None and "set pk" in raised.value.hint
    finally:
        tables.sql(f"DROP TABLE {tables.name}_nk")


def test_check_published_needs_the_signal_table_and_says_validate_fix(tables: BinlogTables) -> None:
    MysqlChunkReader(tables.config, tables.engine).check_published()  # the fixture created it
    missing = dataclasses.replace(tables.config, signal_table=f"{tables.database}.{tables.name}_none")
    with pytest.raises(SourceError, match="does not exist") as raised:
        MysqlChunkReader(missing, tables.engine).check_published()
    assert raised.value.hint is not None and "dbfanout validate --fix" in raised.value.hint


def test_the_default_signal_table_is_in_the_source_database() -> None:
    from tests.poller.mysql_binlog_support import poller_config

    config = poller_config("mysql+pymysql://u@h/shop", ["orders"])
    assert config.signal_table == "public.dbfanout_signal"  # the config's (PostgreSQL's) default
    assert signal_table(config) == "shop.dbfanout_signal"
    assert signal_table(dataclasses.replace(config, signal_table="ops.sig")) == "ops.sig"


# ------------------------------------------------------------------------------ the window in the binlog


def test_barrier_then_watermark_in_the_binlog_and_an_empty_chunk_writes_no_watermark(tables: BinlogTables) -> None:
    tables.insert([1, 2, 3])
    config, sig = tables.config, signal_table(tables.config)
    reader = MysqlChunkReader(config, tables.engine)
    start = binlog_here(config)
    # When a chunk is read, then an empty one (the table read to its end)
    with tables.engine.connect() as conn:
        chunk = reader.read(conn, _state(tables.qualified, 10), None, chunk_id="c1")
        assert chunk is not None and len(chunk.tuples) == 3 and not chunk.more
        empty = reader.read(conn, _state(tables.qualified, 10, last_key={"id": 3}), None, chunk_id="c2")
        assert empty is not None and not empty.tuples and empty.last_key is None
        assert not conn.in_transaction()  # left with no transaction open
    # Then the binlog carries: barrier, watermark c1, barrier (none for the empty chunk), in that order
    signals = [signal_of(c.after, config.name) for c in binlog_changes(config, start, {sig})]
    assert [(s[0], s[1] if s[0] == "watermark" else "") for s in signals if s] == [
        ("barrier", ""), ("watermark", "c1"), ("barrier", ""),
    ]  # fmt: skip
    barriers = {s[1] for s in signals if s and s[0] == "barrier"}
    assert len(barriers) == 2  # a fresh id each time: each barrier is a change the binlog carries
    # (another poller's signal rows are not this poller's)
    assert all(signal_of(c.after, "someone else") is None for c in binlog_changes(config, start, {sig}))


class _Interleaved(MysqlChunkReader):
    """Commits another connection's update of row 3 after the chunk's snapshot, before its watermark."""

    def __init__(self, config: PollerConfig, engine: sa.Engine, tables: BinlogTables) -> None:
        super().__init__(config, engine)
        self.tables = tables

    def commit_watermark(self, conn: sa.Connection, chunk: Chunk) -> None:
        self.tables.sql("UPDATE {t} SET v = 'after snapshot' WHERE id = 3")
        super().commit_watermark(conn, chunk)


def test_a_change_after_the_chunks_snapshot_lands_between_the_window_start_and_the_watermark(
    tables: BinlogTables,
) -> None:
    # Given rows 1..5; the window starts here; row 2 changes before the read
    tables.insert([1, 2, 3, 4, 5])
    config, sig = tables.config, signal_table(tables.config)
    start = binlog_here(config)
    tables.sql("UPDATE {t} SET v = 'before read' WHERE id = 2")
    # When the chunk is read while row 3 changes after its snapshot (before the watermark commits)
    reader = _Interleaved(config, tables.engine, tables)
    with tables.engine.connect() as conn:
        chunk = reader.read(conn, _state(tables.qualified, 10), (1, 0), chunk_id="w1")
    assert chunk is not None
    values = {t[0]: t[1] for t in chunk.tuples}
    # Then the snapshot saw the change before it, not the one after it
    assert values[2] == "before read" and values[3] == "x"
    # And in the binlog both changes are inside the window: after its start, before the watermark;
    # the later one after the barrier
    changes = binlog_changes(config, start, {sig, tables.qualified})
    order = [(c.table, (c.after or {}).get("kind") or (c.after or {}).get("v")) for c in changes]
    assert order == [
        (tables.qualified, "before read"), (sig, "barrier"), (tables.qualified, "after snapshot"), (sig, "watermark"),
    ]  # fmt: skip
    assert all(c.position > start for c in changes)
    # So the window drops both keys (the binlog delivers their newer state) and emits only the others
    for change in changes:
        if signal_of(change.after, config.name) == ("watermark", "w1", {}):
            break
        keys = [tuple(image[p] for p in change.pk) for image in (change.after, change.before) if image]
        chunk.saw((1, 1), change.table, keys)
    chunk.ready_at = NOW
    taken, state = chunk.take(10)
    assert [t[0] for t in taken] == [1, 4, 5] and chunk.dropped == {2, 3}
    assert state.tables == () and state.finished_at == NOW and state.rows == 3


def test_the_request_statement_is_read_from_the_binlog_by_signal_of(tables: BinlogTables) -> None:
    config, sig = tables.config, signal_table(tables.config)
    start = binlog_here(config)
    statement, params = mysql_request_statement(config, tables=[tables.qualified], where="n >= 1", chunk_size=7)
    with tables.engine.begin() as conn:
        conn.execute(statement, params)
    cancel, cancel_params = mysql_request_statement(config, cancel=True)
    with tables.engine.begin() as conn:  # a second request replaces the first (one row per poller)
        conn.execute(cancel, cancel_params)
    signals = [signal_of(c.after, config.name) for c in binlog_changes(config, start, {sig})]
    assert signals == [
        ("request", params["id"], {"action": "snapshot", "tables": [tables.qualified], "where": "n >= 1",
                                   "chunk_size": 7}),
        ("request", cancel_params["id"], {"action": "cancel"}),
    ]  # fmt: skip
    assert signals[0] is not None
    state, warning = apply_request(config, None, signals[0][2], signals[0][1], NOW)
    assert warning is None and state is not None
    assert state.tables == (tables.qualified,) and state.where == "n >= 1" and state.chunk_size == 7


def test_a_chunk_reads_a_range_of_the_key_not_the_table_before_it(tables: BinlogTables) -> None:
    # Given a composite-key table of 6,000 rows, and a chunk to read near its end
    rows = [{"a": i // 10, "b": f"b{i % 10}", "v": "x"} for i in range(6000)]
    with tables.engine.begin() as conn:
        conn.execute(sa.text(f"INSERT INTO {tables.composite} (a, b, v) VALUES (:a, :b, :v)"), rows)
    table = f"{tables.database}.{tables.composite}"
    reader = MysqlChunkReader(tables.config, tables.engine)
    reader.pk(table)  # its lookup is not the chunk's cost
    state = _state(table, 5, last_key={"a": 590, "b": "b3"})

    def handler_reads(conn: sa.Connection) -> int:
        shown = conn.execute(sa.text("SHOW SESSION STATUS LIKE 'Handler_read%'")).all()
        return sum(int(value) for _, value in shown)

    with tables.engine.connect() as conn:
        before = handler_reads(conn)
        chunk = reader.read(conn, state, None)
        read = handler_reads(conn) - before
    # Then it has the next rows in key order, and the server read a few rows for them, not the 5,900
    # before them (a row comparison is a full scan on MariaDB: the keyset is written out)
    assert chunk is not None and [chunk.key_of(t) for t in chunk.tuples] == [(590, f"b{i}") for i in range(4, 9)]
    assert read < 100, f"{read} handler reads for a chunk of 5"


def test_validate_wants_binlog_order_commits_on_for_snapshots() -> None:
    # MySQL's setting (MariaDB has none: it commits in binlog order always), read by validate's query
    from dbfanout.ops import binlog_checks
    from tests.poller.mysql_binlog_support import poller_config

    config = poller_config("mysql+pymysql://u@h/shop", ["orders"])
    check = binlog_checks._commit_order_check
    assert [(c.status, c.name) for c in check(config, {"binlog_order_commits": "ON"})] == [
        ("ok", "binlog_order_commits")
    ]
    (off,) = check(config, {"binlog_order_commits": "OFF"})
    assert off.status == "warn" and "set it to ON" in off.detail
    assert list(check(config, {})) == []  # MariaDB


def test_a_timestamp_is_read_as_the_binlog_carries_it_whatever_the_sessions_zone(tables: BinlogTables) -> None:
    # Given a table keyed by a TIMESTAMP, written by a session in another zone
    name = f"{tables.name}_ts"
    with tables.engine.begin() as conn:
        conn.execute(sa.text(f"CREATE TABLE {name} (at TIMESTAMP(3) NOT NULL, v INT, PRIMARY KEY (at))"))
    try:
        table = f"{tables.database}.{name}"
        start = binlog_here(tables.config)
        with tables.engine.begin() as conn:
            conn.exec_driver_sql("SET time_zone = '+05:00'")
            conn.execute(sa.text(f"INSERT INTO {name} VALUES ('2024-01-02 03:04:05.500', 1)"))
        (inserted,) = binlog_changes(tables.config, start, {table})
        # When a chunk is read on a connection whose session is in that zone too
        with tables.engine.connect() as conn:
            conn.exec_driver_sql("SET time_zone = '+05:00'")
            chunk = MysqlChunkReader(tables.config, tables.engine).read(conn, _state(table, 10), None)
        # Then its row has the binlog's value (UTC), so a change of that key in the window drops it
        assert chunk is not None and inserted.after is not None
        assert chunk.tuples[0][0] == inserted.after["at"] == dt.datetime(2024, 1, 1, 22, 4, 5, 500000)
        chunk.saw((1, 1), table, [(inserted.after["at"],)])
        assert chunk.dropped == {inserted.after["at"]}
    finally:
        tables.sql(f"DROP TABLE {name}")

"""kind = "mysql_binlog": binlog contents the plain row path does not cover (MariaDB, real servers).

``BINARY(n)`` keys the binlog writes without their trailing ``0x00`` bytes; XA transactions,
whose rows the binlog holds from ``XA PREPARE`` on; ``TRUNCATE``, a statement with no rows;
MariaDB's compressed events (``log_bin_compress = ON``, a private server of its own); and
statement-format changes (a session's ``binlog_format = STATEMENT``), which have no rows either.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from poller.sources.mysql_binlog.position import BinlogPosition
from poller.sources.mysql_binlog.source import MysqlBinlogSource
from poller.state.memory import MemoryStateStore
from poller.tick.events import page_batch
from shared.errors import SourceError
from shared.models import Position, RowChange
from tests.poller.mysql_binlog_support import BinlogTables, binlog_tables, events_of
from tests.poller.tick_support import RecordingSink, drain
from tests.support import otel
from tests.support.private_mariadb import binaries_missing, start_private_mariadb

pytestmark = pytest.mark.integration


@pytest.fixture
def tables(mysql_binlog_url: str) -> Iterator[BinlogTables]:
    with binlog_tables(mysql_binlog_url) as made:
        yield made


def _started(config: Any) -> tuple[MysqlBinlogSource, Position]:
    source = MysqlBinlogSource(config)
    first = source.fetch(None, 10)
    assert len(first) == 0 and first.advance is not None
    return source, first.advance


def _read(source: MysqlBinlogSource, after: Position, limit: int = 50) -> tuple[list[RowChange], Position]:
    """Every change after ``after`` in one tick's stream, and where the last page ended."""
    events: list[RowChange] = []
    with source.pinned():
        while True:
            page = source.fetch(after, limit)
            if len(page):
                events.extend(page_batch(source._config, source.fingerprint, page).events)
            if page.end is not None:
                after = page.end
            if len(page) < limit:
                return events, after


def _summary(events: list[RowChange]) -> list[tuple[str | None, Any]]:
    return [(e.change, e.pk["id"]) for e in events]


# ---------------------------------------------------------------------------------------- BINARY(n) keys


def test_binary_keys_ending_in_zero_bytes_arrive_as_stored_in_every_change(tables: BinlogTables) -> None:
    # Given a BINARY(16) keyed table with a BINARY(4) column, and keys ending in 0x00 (1 in 256 random UUIDs)
    table = f"{tables.name}_bin"
    tables.sql(f"CREATE TABLE {table} (id BINARY(16) PRIMARY KEY, b BINARY(4), v VARCHAR(10))")
    try:
        qualified = f"{tables.database}.{table}"
        source, start = _started(dataclasses.replace(tables.config, tables=(qualified,)))
        zero, plain = bytes(range(1, 14)) + b"\0\0\0", bytes(range(1, 17))
        # When rows are inserted, updated (one changes its key to another ending in 0x00) and deleted
        tables.sql(
            f"INSERT INTO {table} VALUES (:z, :b, 'a'), (:p, NULL, 'a')",
            params={"z": zero, "p": plain, "b": b"\1\0\0\0"},
        )
        moved = b"\0" * 16
        tables.sql(f"UPDATE {table} SET v = 'b', id = :m WHERE id = :z", params={"m": moved, "z": zero})
        tables.sql(f"DELETE FROM {table} WHERE id = :m", params={"m": moved})
        events, _ = _read(source, start)
        # Then every key and value arrives exactly as the table holds it (and as a SELECT reads it)
        assert _summary(events) == [("insert", zero), ("insert", plain), ("update", moved), ("delete", moved)]
        insert, _, update, delete = events
        assert insert.after == {"id": zero, "b": b"\1\0\0\0", "v": "a"}
        assert (
            update.before is not None
            and update.before["id"] == zero
            and update.after == {"id": moved, "b": b"\1\0\0\0", "v": "b"}
        )
        assert delete.before == {"id": moved, "b": b"\1\0\0\0", "v": "b"}
    finally:
        tables.sql(f"DROP TABLE IF EXISTS {table}")


# ---------------------------------------------------------------------------------------- XA


@contextmanager
def _xa(engine: sa.Engine) -> Iterator[sa.Connection]:
    """A connection for XA statements (no implicit BEGIN around them); a transaction it left
    prepared (a failed test) is rolled back, so it holds no lock on the tables being dropped."""
    conn = engine.connect().execution_options(isolation_level="AUTOCOMMIT")
    try:
        yield conn
    finally:
        conn.close()
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as admin:
            for row in admin.exec_driver_sql("XA RECOVER").all():
                xid = row[3].decode() if isinstance(row[3], bytes) else str(row[3])
                if xid in ("a", "b", "c"):
                    admin.exec_driver_sql(f"XA ROLLBACK '{xid}'")


def test_xa_rows_arrive_at_commit_never_after_rollback_and_one_phase_commits(tables: BinlogTables) -> None:
    # Given a poller that has taken its start, an XA transaction prepared (rows 10, 11), a plain
    # transaction committed after the prepare (row 20), and rows before both (row 1)
    source, start = _started(tables.config)
    tables.insert([1])
    with _xa(tables.engine) as xa:
        for statement in ("XA START 'a'", f"INSERT INTO {tables.name} VALUES (10, 'xa', 0), (11, 'xa', 0)",
                          "XA END 'a'", "XA PREPARE 'a'"):  # fmt: skip
            xa.exec_driver_sql(statement)
        tables.insert([20])
        # When the poller reads while the XA transaction has no outcome
        pending, end = _read(source, start)
        # Then only what precedes the prepare arrives, and the checkpoint stays before it
        assert _summary(pending) == [("insert", 1)]
        assert BinlogPosition.from_position(end).txn_pos < _prepare_offset(tables)
        # When it commits, a second one rolls back, a third commits in one phase
        xa.exec_driver_sql("XA COMMIT 'a'")
        for statement in ("XA START 'b'", f"INSERT INTO {tables.name} VALUES (30, 'rolled back', 0)", "XA END 'b'",
                          "XA PREPARE 'b'", "XA ROLLBACK 'b'", "XA START 'c'",
                          f"INSERT INTO {tables.name} VALUES (40, 'one phase', 0)", "XA END 'c'",
                          "XA COMMIT 'c' ONE PHASE"):  # fmt: skip
            xa.exec_driver_sql(statement)
        tables.insert([50])
    committed, after = _read(source, end)
    # Then the committed XA rows arrive (at the prepare's place: before the row committed meanwhile),
    # the rolled-back row never, the one-phase row in order, each once
    assert _summary(committed) == [("insert", 10), ("insert", 11), ("insert", 20), ("insert", 40), ("insert", 50)]
    # and a fresh source resuming from the first checkpoint delivers the same ids (nothing lost nor added)
    again, after_again = _read(MysqlBinlogSource(tables.config), end)
    assert [e.event_id for e in again] == [e.event_id for e in committed] and after_again == after
    assert _read(source, after)[0] == []


def _prepare_offset(tables: BinlogTables) -> int:
    """Where the binlog's last XA PREPARE transaction begins (its GTID event)."""
    with tables.engine.connect() as conn:
        file = conn.execute(sa.text("SHOW MASTER STATUS")).one()[0]
        events = conn.execute(sa.text(f"SHOW BINLOG EVENTS IN '{file}'")).all()
    starts = [e[1] for e in events if e[2] == "Gtid" and "XA START" in str(e[5])]
    return int(starts[-1])


# ---------------------------------------------------------------------------------------- TRUNCATE


def test_a_truncate_of_a_polled_table_is_warned_counted_and_kept_in_the_checkpoint(
    tables: BinlogTables, caplog: pytest.LogCaptureFixture
) -> None:
    # Given a poller that has ticked once, and rows (metrics recorded in memory)
    otel.install()
    store, sink, source = MemoryStateStore("p"), RecordingSink(), MysqlBinlogSource(tables.config)
    drain(tables.config, source, store, sink)
    tables.insert([1, 2])
    # When its table is truncated (a statement in the binlog, no rows), another table too, and a row is inserted
    other = f"{tables.name}_other"
    tables.sql(f"CREATE TABLE {other} (id INT PRIMARY KEY)")
    try:
        tables.sql(f"TRUNCATE TABLE {tables.name}")
        tables.sql(f"TRUNCATE {other}")
        tables.insert([3])
        with caplog.at_level(logging.WARNING):
            drain(tables.config, source, store, sink)
    finally:
        tables.sql(f"DROP TABLE IF EXISTS {other}")
    # Then the rows still arrive, a WARNING names the truncated table, and the checkpoint's metadata
    # (what `dbfanout status` shows) records it, once
    assert _summary(events_of(sink.accepted)) == [("insert", 1), ("insert", 2), ("insert", 3)]
    warnings = [r.getMessage() for r in caplog.records if "TRUNCATE" in r.getMessage()]
    assert len(warnings) == 1 and tables.qualified in warnings[0], warnings
    assert otel.total("dbfanout.truncates", poller=tables.config.name, table=tables.qualified) == 1
    assert otel.total("dbfanout.truncates", table=f"{tables.database}.{other}") == 0
    snap = store.load()
    assert snap is not None
    truncates = snap.doc.checkpoint.metadata["source"]["truncates"]
    assert [t["table"] for t in truncates] == [tables.qualified]
    # and a restarted poller carries it on in the checkpoint it writes next
    tables.insert([4])
    drain(tables.config, MysqlBinlogSource(tables.config), store, sink)
    snap = store.load()
    assert snap is not None and snap.doc.checkpoint.metadata["source"]["truncates"] == truncates


# ---------------------------------------------------------------------------------------- compressed events


@pytest.fixture(scope="module")
def compressed_url() -> Iterator[str]:
    """A private MariaDB writing compressed binlog events (log_bin_compress = ON, from 10 bytes)."""
    missing = binaries_missing()
    if missing:
        pytest.skip(missing)
    server = start_private_mariadb(extra=("--log-bin-compress=ON", "--log-bin-compress-min-len=10"))
    try:
        yield server.url
    finally:
        server.stop()


def test_compressed_row_and_query_events_are_decompressed_and_delivered(compressed_url: str) -> None:
    with binlog_tables(compressed_url) as tables:
        # Given a poller on a server that compresses its binlog events
        source, start = _started(tables.config)
        long = "x" * 30
        # When rows are inserted, updated (a key change too) and deleted, in single and multi-row
        # events, and a long statement (compressed query event) runs on the table
        tables.sql("INSERT INTO {t} (id, v, n) VALUES (1, :v, 0), (2, 'b', 0)", params={"v": long})
        tables.sql("UPDATE {t} SET v = 'c', n = 1 WHERE id = 1", "UPDATE {t} SET id = 3 WHERE id = 2")
        tables.sql("INSERT INTO {c} VALUES (1, 'k', :v)", params={"v": long})
        tables.sql(f"ALTER TABLE {tables.name} COMMENT '{'a' * 300}'")
        tables.sql("DELETE FROM {t} WHERE id = 1", "DELETE FROM {c}")
        tables.sql("TRUNCATE TABLE {c}")  # a compressed statement the poller must understand
        with tables.engine.connect() as conn:
            compressed = [e[2] for e in conn.execute(sa.text("SHOW BINLOG EVENTS")).all()]
        events, _ = _read(source, start)
        truncated = [t["table"] for t in source._truncates._seen]
    # Then the server wrote compressed events, and every change arrives whole, in order
    kinds = {"Write_rows_compressed_v1", "Update_rows_compressed_v1", "Delete_rows_compressed_v1", "Query_compressed"}
    assert kinds <= set(compressed), set(compressed)
    assert [(e.change, *e.pk.values()) for e in events] == [
        ("insert", 1), ("insert", 2), ("update", 1), ("update", 3), ("insert", 1, "k"),
        ("delete", 1), ("delete", 1, "k"),
    ]  # fmt: skip
    assert events[0].after == {"id": 1, "v": long, "n": 0}
    assert events[2].before == {"id": 1, "v": long, "n": 0} and events[2].after == {"id": 1, "v": "c", "n": 1}
    assert events[3].before == {"id": 2, "v": "b", "n": 0} and events[4].after == {"a": 1, "b": "k", "v": long}
    # and the compressed TRUNCATE statement was read as one
    assert truncated == [f"{tables.database}.{tables.composite}"]


# ---------------------------------------------------------------------------------------- changes without rows


def test_a_statement_format_change_of_a_polled_table_stops_the_poller_before_it(tables: BinlogTables) -> None:
    # Given a poller that has taken its start, a row written normally, and a statement-format write
    # of another table (a session may set binlog_format = STATEMENT: its DML has no rows in the binlog)
    source, start = _started(tables.config)
    other = f"{tables.name}_other"
    tables.sql(f"CREATE TABLE {other} (id INT PRIMARY KEY)")
    try:
        tables.insert([1])
        with tables.engine.connect() as conn:
            conn.exec_driver_sql("SET SESSION binlog_format = 'STATEMENT'")
            conn.exec_driver_sql(f"INSERT INTO {other} VALUES (1)")
            conn.commit()
            # When such a session changes the poller's table (in a transaction with a row change)
            conn.exec_driver_sql(f"INSERT INTO {tables.name} (id, v, n) VALUES (2, 'statement', 0)")
            conn.exec_driver_sql(f"UPDATE `{tables.database}`.{tables.name} SET n = 5 WHERE id = 1")
            conn.commit()
        tables.insert([3])
        # Then the poller delivers what precedes it and stops with an error naming the table and the setting
        with pytest.raises(SourceError, match="statement-format change of") as stopped:
            _read(source, start)
        assert tables.qualified in str(stopped.value) and "binlog_format" in str(stopped.value.hint)
        page = MysqlBinlogSource(tables.config).fetch(start, 1)  # the row before it
        assert [r.event.pk["id"] for r in page.rows if r.event] == [1]
        # and a poller resuming from its checkpoint stops there again: it never skips past the change
        assert page.end is not None
        with pytest.raises(SourceError, match="statement-format"):
            _read(MysqlBinlogSource(tables.config), page.end)
    finally:
        tables.sql(f"DROP TABLE IF EXISTS {other}")


def test_a_statement_format_load_data_into_a_polled_table_stops_the_poller_before_it(
    tables: BinlogTables, tmp_path: Path
) -> None:
    # Given a poller that has taken its start, and a STATEMENT-format session that loads a file into
    # its table (LOAD DATA: Begin_load_query and Execute_load_query events, no rows; the library
    # decodes no statement text of it)
    source, start = _started(tables.config)
    tables.insert([1])
    data = tmp_path / "rows.tsv"
    data.write_text("20\tloaded\t0\n21\tloaded\t0\n")
    engine = sa.create_engine(tables.url, connect_args={"local_infile": True})
    try:
        with engine.connect() as conn:
            conn.exec_driver_sql("SET SESSION binlog_format = 'STATEMENT'")
            conn.exec_driver_sql(f"LOAD DATA LOCAL INFILE '{data}' INTO TABLE {tables.name}")
            conn.commit()
    finally:
        engine.dispose()
    tables.insert([3])
    # When the poller reads it, Then it stops with an error naming the table, never skipping the rows
    with pytest.raises(SourceError, match=f"statement-format change of {tables.qualified}"):
        _read(source, start)
    # and its checkpoint never passes the load: a resumed poller stops there again
    page = MysqlBinlogSource(tables.config).fetch(start, 1)
    assert [r.event.pk["id"] for r in page.rows if r.event] == [1] and page.end is not None
    with pytest.raises(SourceError, match="statement-format"):
        _read(MysqlBinlogSource(tables.config), page.end)

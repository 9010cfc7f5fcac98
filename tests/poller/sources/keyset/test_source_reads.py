"""The keyset read engine (poller.sources.engines, ``reads=True``): what an idle tick costs on the wire,
and a dead pooled connection (no pre-ping) noticed by the read itself and replaced in the same tick."""

from __future__ import annotations

import dataclasses
import os
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from poller.sources.engines import make_engine
from poller.sources.keyset.source import SqlSource
from poller.state.memory import MemoryStateStore
from poller.tick.lifecycle import TickResult, run_tick
from tests.poller.tick_support import RecordingSink, SourceTable, make_poller
from tests.support.databases import unique_name
from tests.support.ports import wait_until


@pytest.fixture
def table_url(request: pytest.FixtureRequest) -> Iterator[tuple[SourceTable, str]]:
    """A source table on the parametrised server and the URL its read engine is cached under."""
    url: str = request.getfixturevalue(request.param)
    if request.param == "pg_url":  # an engine of this test's own: its connections are the traced ones
        url += ("&" if "?" in url else "?") + f"application_name={unique_name('reads')}"
    table = SourceTable(url, unique_name("reads"))
    yield table, url
    make_engine(url, reads=True).dispose()
    with table.engine.begin() as conn:
        conn.execute(sa.text(f"DROP TABLE {table.table}"))
    table.engine.dispose()


class Ticker:
    """run_tick as the timer calls it, on the process-wide read engine (no engine passed)."""

    def __init__(self, table: SourceTable, url: str) -> None:
        self.poller = dataclasses.replace(make_poller(url, table.table), soft_delete_column=None)
        self.source = SqlSource(self.poller)
        self.store, self.sink = MemoryStateStore("orders"), RecordingSink()

    def __call__(self) -> TickResult:
        return run_tick(self.poller, self.source, self.store, self.sink, owner_id="host-a")

    def delivered(self) -> list[int]:
        return [e.pk["id"] for b in self.sink.accepted for e in b.events]


@pytest.mark.parametrize("table_url", ["pg_url"], indirect=True)
def test_an_idle_tick_on_postgresql_is_one_round_trip(table_url: tuple[SourceTable, str]) -> None:
    # Given a caught-up poller whose read engine's connections write libpq's protocol trace
    table, url = table_url
    fd, path = tempfile.mkstemp(suffix=".trace")
    engine = make_engine(url, reads=True)

    def trace(dbapi_connection: Any, record: Any) -> None:
        dbapi_connection.pgconn.trace(fd)

    sa.event.listen(engine.pool, "connect", trace)
    try:
        tick = Ticker(table, url)
        table.upsert([1])
        assert tick().rows == 1
        # When it ticks three times while nothing changes
        before = os.path.getsize(path)
        results = [tick().stop_reason for _ in range(3)]
        with open(path, encoding="utf-8", errors="replace") as f:
            f.seek(before)
            sent = [line.split("\t")[3].strip() for line in f if line.split("\t")[1:2] == ["F"]]
    finally:
        sa.event.remove(engine.pool, "connect", trace)
        engine.dispose()  # its connections stop writing to the file
        os.close(fd)
        os.unlink(path)
    # Then each tick sent one flight ending in one Sync: no ping, no BEGIN, no ROLLBACK (a Query)
    assert results == ["caught_up"] * 3
    assert sent.count("Sync") == 3 and "Query" not in sent, sent


def _backend_id(dbapi_connection: Any) -> int:
    """The server's id of a DBAPI connection, read from the driver (no query)."""
    info = getattr(dbapi_connection, "info", None)
    if info is not None and hasattr(info, "backend_pid"):
        return int(info.backend_pid)  # psycopg
    return int(dbapi_connection.thread_id())  # pymysql


def _kill(admin: sa.Engine, backend: int) -> None:
    """End one server session from another connection, and wait until the server shows it gone."""
    postgres = admin.dialect.name == "postgresql"
    with admin.connect() as conn:
        conn.execute(sa.text("SELECT pg_terminate_backend(:p)" if postgres else "KILL :p"), {"p": backend})
        conn.commit()

    def gone() -> bool:
        with admin.connect() as conn:
            query = (
                "SELECT count(*) FROM pg_stat_activity WHERE pid = :p"
                if postgres
                else "SELECT count(*) FROM information_schema.processlist WHERE id = :p"
            )
            return int(conn.execute(sa.text(query), {"p": backend}).scalar_one()) == 0

    wait_until(gone, 10, f"the server ending session {backend}")


@pytest.mark.parametrize("table_url", ["pg_url", "mysql_url"], indirect=True)
def test_a_connection_killed_between_ticks_is_replaced_and_the_next_tick_delivers(
    table_url: tuple[SourceTable, str],
) -> None:
    # Given a poller that delivered a row, and every server session its read engine checked out
    table, url = table_url
    engine = make_engine(url, reads=True)
    engine.dispose()  # only this test's sessions in its pool
    checked_out: list[int] = []

    def record(dbapi_connection: Any, record: Any, proxy: Any) -> None:
        checked_out.append(_backend_id(dbapi_connection))

    sa.event.listen(engine.pool, "checkout", record)
    try:
        tick = Ticker(table, url)
        table.upsert([1])
        assert tick().rows == 1
        killed = set(checked_out)
        assert killed, "the tick checked out no connection"
        # When the server ends those sessions between ticks (a restart, a failover, an idle cut)
        for backend in killed:
            _kill(table.engine, backend)
        table.upsert([2])
        checked_out.clear()
        result = tick()
    finally:
        sa.event.remove(engine.pool, "checkout", record)
    # Then the next tick reads on a new session and delivers the new row (no failed tick)
    assert result.stop_reason == "caught_up" and result.rows == 1
    assert tick.delivered() == [1, 2]
    assert checked_out and not killed & set(checked_out[1:]), (killed, checked_out)


@pytest.mark.parametrize("table_url", ["pg_url", "mysql_url"], indirect=True)
def test_a_migration_after_many_idle_ticks_shows_in_the_next_tick(table_url: tuple[SourceTable, str]) -> None:
    # Given a poller that ran the same idle read many times on its connection (no transaction ends
    # between them in autocommit: a driver may have prepared the statement on the server)
    table, url = table_url
    tick = Ticker(table, url)
    table.upsert([1])
    assert tick().rows == 1
    assert [tick().stop_reason for _ in range(8)] == ["caught_up"] * 8
    # When a migration adds a column and a row is written
    with table.engine.begin() as conn:
        conn.execute(sa.text(f"ALTER TABLE {table.table} ADD COLUMN extra VARCHAR(20)"))
    table.upsert([2])
    # Then the next tick delivers it, with the new column
    result = tick()
    assert result.stop_reason == "caught_up" and result.rows == 1
    after = tick.sink.accepted[-1].events[0].after
    assert after is not None and "extra" in after

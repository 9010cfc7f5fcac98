"""Issue 42: no slot hoards WAL. A new pg_logical slot whose tables are quiet advances from its first
tick, before any delivery, whether the server's writes go to unpublished tables of its database or
to another database (WAL is cluster-wide) — watched on ``restart_lsn``, what PostgreSQL keeps.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import sqlalchemy as sa

from poller.sources.pg_logical.source import PgLogicalSource
from poller.state.memory import MemoryStateStore
from poller.tick.lifecycle import run_tick
from shared.models import Lsn
from tests.poller.pg_logical_support import LogicalTable, events_of, logical_table
from tests.poller.tick_support import RecordingSink
from tests.support.ports import wait_until

pytestmark = pytest.mark.integration


@pytest.fixture
def logical(pg_logical_url: str) -> Iterator[LogicalTable]:
    with logical_table(pg_logical_url) as table:
        yield table


@pytest.fixture
def other_database(logical: LogicalTable) -> Iterator[sa.Engine]:
    """Another database of the same server, with a table to write to (dropped afterwards)."""
    name = f"{logical.name}_db"
    admin = logical.engine.execution_options(isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f"CREATE DATABASE {name}"))
    engine = sa.create_engine(sa.engine.make_url(logical.url).set(database=name))
    try:
        with engine.begin() as conn:
            conn.execute(sa.text("CREATE TABLE busy (id SERIAL PRIMARY KEY, v TEXT)"))
        yield engine
    finally:
        engine.dispose()
        with admin.connect() as conn:
            conn.execute(sa.text(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"))


def _restart_lsn(table: LogicalTable) -> Lsn:
    with table.engine.connect() as conn:
        text = conn.execute(
            sa.text("SELECT CAST(restart_lsn AS text) FROM pg_replication_slots WHERE slot_name = :s"),
            {"s": table.config.slot},
        ).scalar_one()
    return Lsn.parse(text)


def _write(engine: sa.Engine, table: str) -> None:
    with engine.begin() as conn:
        conn.execute(sa.text(f"INSERT INTO {table} (v) SELECT repeat('x', 200) FROM generate_series(1, 500)"))


def test_a_quiet_new_slot_advances_while_other_tables_and_databases_write(
    logical: LogicalTable, other_database: sa.Engine
) -> None:
    unpublished = f"{logical.name}_busy"
    logical.sql(f"CREATE TABLE {unpublished} (id SERIAL PRIMARY KEY, v TEXT)")
    config, store, sink = logical.config, MemoryStateStore("p"), RecordingSink()
    source = PgLogicalSource(config)
    try:
        for writer in (other_database, logical.engine):  # another database first, then this one's other table
            # Given a slot with nothing of its tables to deliver (never delivered anything yet)
            start = _restart_lsn(logical)
            table = "busy" if writer is other_database else unpublished

            def advanced(writer: sa.Engine = writer, table: str = table, start: Lsn = start) -> bool:
                # When the server writes elsewhere and the poller ticks
                _write(writer, table)
                run_tick(config, source, store, sink)
                return _restart_lsn(logical) > start

            # Then the slot's restart_lsn moves on (PostgreSQL logs the record it needs within 15 s)
            wait_until(advanced, 90, f"restart_lsn past {start} with writes to {table} only")
        assert sink.accepted == []
        # And a change of its own table still arrives: the slot never went past it
        logical.insert([1])
        run_tick(config, source, store, sink)
        assert [e.pk["id"] for e in events_of(sink.accepted)] == [1]
    finally:
        source.close()
        logical.sql(f"DROP TABLE IF EXISTS {unpublished}")

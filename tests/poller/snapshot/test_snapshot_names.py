"""Quoted and mixed-case names on PostgreSQL: a snapshot of ``"Sales"."Orders"``, a notify trigger on
it, and channels no two pollers share (``orders-a`` and ``orders_a``)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import pytest
import sqlalchemy as sa

from dbfanout.ops.notify import create_notify_triggers, drop_notify_triggers, missing_notify_triggers
from poller.snapshot.postgres import request_statement
from poller.sources.pg_logical.source import PgLogicalSource, setup_sql
from poller.state.memory import MemoryStateStore
from poller.tick.wake import NotifyWaker, notify_channel, notify_trigger_name
from shared.config import PollerConfig
from tests.poller.pg_logical_support import events_of, poller_config
from tests.poller.tick_support import RecordingSink, drain
from tests.support.databases import unique_name

pytestmark = pytest.mark.integration


@pytest.fixture
def mixed(pg_logical_url: str) -> Iterator[tuple[sa.Engine, PollerConfig]]:
    """``"Sales X"."Orders"`` (a mixed-case schema with a space, a mixed-case table and column), with
    its publication and slot; dropped afterwards."""
    pg_url = pg_logical_url
    engine, name = sa.create_engine(pg_url), unique_name("mx")
    schema = f"Sales X {name}"
    config = poller_config(pg_url, f"{schema}.Orders", slot=name, publication=name, signal_table=f"{name}_signal",
                           snapshot_chunk_size=4)  # fmt: skip
    with engine.begin() as conn:
        conn.execute(sa.text(f'CREATE SCHEMA "{schema}"'))
        conn.execute(sa.text(f'CREATE TABLE "{schema}"."Orders" ("Id" int PRIMARY KEY, "Region" text, v int)'))
        conn.execute(sa.text(f'INSERT INTO "{schema}"."Orders" VALUES (:i, :r, 0)'),
                     [{"i": i, "r": "eu" if i % 2 else "us"} for i in range(10)])  # fmt: skip
    try:
        for statement in setup_sql(config):
            with engine.begin() as conn:
                conn.execute(sa.text(statement))
        yield engine, config
    finally:
        with engine.begin() as conn:
            conn.execute(sa.text("SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots"
                                 " WHERE slot_name = :s"), {"s": name})  # fmt: skip
            conn.execute(sa.text(f"DROP PUBLICATION IF EXISTS {name}"))
            conn.execute(sa.text(f'DROP SCHEMA "{schema}" CASCADE'))
            conn.execute(sa.text(f"DROP TABLE IF EXISTS {config.signal_table}"))
        engine.dispose()


def test_a_mixed_case_schema_and_table_are_snapshotted_with_a_condition_on_a_mixed_case_column(
    mixed: tuple[sa.Engine, PollerConfig],
) -> None:
    engine, config = mixed
    table = config.tables[0]
    # Given a live poller of "Sales X ..."."Orders" (on main: "has no primary key", to_regclass unquoted)
    store, sink = MemoryStateStore("p"), RecordingSink()
    drain(config, PgLogicalSource(config), store, sink)
    # When a snapshot of the rows of one region is requested
    statement, params = request_statement(config, where="\"Region\" = 'eu'")
    with engine.begin() as conn:
        conn.execute(statement, params)
    drain(config, PgLogicalSource(config), store, sink)
    # Then those rows came as reads naming the table as the log does
    reads = [e for e in events_of(sink.accepted) if e.change == "read"]
    assert sorted(e.pk["Id"] for e in reads) == [1, 3, 5, 7, 9]
    assert {e.table for e in reads} == {table}
    snap = store.load()
    assert snap is not None and snap.doc.checkpoint.position is not None
    state = snap.doc.checkpoint.position.snapshot
    assert state is not None and not state.active and state.error is None and state.rows == 5


def test_pollers_whose_names_differ_only_in_punctuation_get_their_own_channels_and_triggers(
    mixed: tuple[sa.Engine, PollerConfig],
) -> None:
    engine, config = mixed
    a, b = replace(config, name="orders-a", wake="notify"), replace(config, name="orders_a", wake="notify")
    plain = replace(config, name="orders_b", wake="notify")
    # The names (on main both were dbfanout_orders_a); a plain name keeps its channel as before
    assert notify_channel(a) != notify_channel(b) and notify_trigger_name(a) != notify_trigger_name(b)
    assert notify_channel(plain) == "dbfanout_orders_b" and notify_channel(b) == "dbfanout_orders_a"
    long = replace(config, name="x" * 80)
    assert len(notify_channel(long)) <= 63 and notify_channel(long) != notify_channel(replace(long, name="x" * 81))
    # When both get their triggers on the mixed-case table (quoted in the DDL)
    try:
        assert create_notify_triggers(a) and create_notify_triggers(b)
        assert missing_notify_triggers(a) == [] == missing_notify_triggers(b)
        waker_a, waker_b = NotifyWaker(a), NotifyWaker(b)
        try:
            waker_a.listen()
            waker_b.listen()
            # Then a commit on the table wakes each of them on its own channel
            with engine.begin() as conn:
                conn.execute(sa.text(f'UPDATE {_quoted(config.tables[0])} SET v = v + 1 WHERE "Id" = 1'))
            assert waker_a.wait(5) and waker_b.wait(5)
        finally:
            waker_a.close()
            waker_b.close()
    finally:
        drop_notify_triggers(a)
        drop_notify_triggers(b)
    assert missing_notify_triggers(a) == list(config.tables)


def _quoted(name: str) -> str:
    return ".".join('"' + part + '"' for part in name.split("."))

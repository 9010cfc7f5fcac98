"""Issue 42 on a real PostgreSQL: partitioned tables, TRUNCATE, and changes of unknown relations.

A partitioned table named in ``tables`` delivers its partitions' changes under its own name
(``publish_via_partition_root``), its snapshot works; a TRUNCATE is logged, counted and recorded
in the checkpoint (never passed in silence); a change of a relation the poller does not know is
a WARNING naming it, and counted.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from poller.ports import SOURCE_NOTES
from poller.sources.pg_logical.source import PgLogicalSource
from poller.state.memory import MemoryStateStore
from shared.config import PollerConfig
from tests.poller.pg_logical_support import LogicalTable, events_of, logical_table, poller_config
from tests.poller.tick_support import RecordingSink, drain
from tests.support import otel

pytestmark = pytest.mark.integration


@pytest.fixture
def logical(pg_logical_url: str) -> Iterator[LogicalTable]:
    with logical_table(pg_logical_url) as table:
        yield table


@pytest.fixture
def parted(pg_logical_url: str) -> Iterator[tuple[LogicalTable, PollerConfig]]:
    """A table partitioned by region (eu, us), with its publication (via root) and slot."""
    with logical_table(pg_logical_url, slot=False) as table:
        name = f"{table.name}_parted"
        table.sql(
            f"CREATE TABLE {name} (id INTEGER, region TEXT, v TEXT, PRIMARY KEY (id, region))"
            " PARTITION BY LIST (region)",
            f"CREATE TABLE {name}_eu PARTITION OF {name} FOR VALUES IN ('eu')",
            f"CREATE TABLE {name}_us PARTITION OF {name} FOR VALUES IN ('us')",
        )
        config = poller_config(
            table.url, name, slot=table.config.slot, publication=table.config.publication,
            signal_table=table.config.signal_table,
        )  # fmt: skip
        table.config = config
        try:
            table.create_slot()
            yield table, config
        finally:
            table.drop_slot()
            table.sql(f"DROP TABLE IF EXISTS {name}")


def test_a_partitioned_tables_changes_arrive_under_its_own_name(parted: tuple[LogicalTable, PollerConfig]) -> None:
    table, config = parted
    name = config.tables[0]
    # Given rows written to both partitions, one updated and one deleted
    table.sql(
        f"INSERT INTO {name} VALUES (1, 'eu', 'a'), (2, 'us', 'b')",
        f"UPDATE {name} SET v = 'c' WHERE id = 1",
        f"DELETE FROM {name} WHERE id = 2",
    )
    store, sink = MemoryStateStore("p"), RecordingSink()
    # When the poller drains
    drain(config, PgLogicalSource(config), store, sink)
    # Then every change arrived, under the partitioned table's name, with its key
    events = events_of(sink.accepted)
    assert [(e.change, e.pk) for e in events] == [
        ("insert", {"id": 1, "region": "eu"}),
        ("insert", {"id": 2, "region": "us"}),
        ("update", {"id": 1, "region": "eu"}),
        ("delete", {"id": 2, "region": "us"}),
    ]
    assert {e.table for e in events} == {f"public.{name}"}


def test_a_snapshot_of_a_partitioned_table_delivers_every_row(parted: tuple[LogicalTable, PollerConfig]) -> None:
    table, config = parted
    name = config.tables[0]
    # Given 30 rows across both partitions that predate the slot, and an initial snapshot
    table.drop_slot()
    table.sql(
        f"INSERT INTO {name} SELECT i, CASE WHEN i % 2 = 0 THEN 'eu' ELSE 'us' END, 'old' FROM generate_series(1, 30) i"
    )
    table.create_slot()
    snap_config = poller_config(
        table.url, name, slot=config.slot, publication=config.publication, signal_table=config.signal_table,
        snapshot="initial", snapshot_chunk_size=7,
    )  # fmt: skip
    store, sink = MemoryStateStore("p"), RecordingSink()
    # When the poller drains
    drain(snap_config, PgLogicalSource(snap_config), store, sink)
    # Then every row came once as a read of the partitioned table
    reads = [e for e in events_of(sink.accepted) if e.change == "read"]
    assert sorted(e.pk["id"] for e in reads) == list(range(1, 31))
    assert {e.table for e in reads} == {f"public.{name}"}


def test_a_truncate_is_logged_counted_and_recorded_in_the_checkpoint(
    logical: LogicalTable, caplog: pytest.LogCaptureFixture
) -> None:
    otel.install()
    counted = otel.total("dbfanout.truncates", table=f"public.{logical.name}")
    store, sink = MemoryStateStore("p"), RecordingSink()
    # Given rows delivered
    logical.insert([1, 2])
    drain(logical.config, PgLogicalSource(logical.config), store, sink)
    # When the table is truncated (nothing follows it) and the poller drains
    logical.sql("TRUNCATE {t}")
    with caplog.at_level(logging.WARNING):
        drain(logical.config, PgLogicalSource(logical.config), store, sink)
    # Then a WARNING names the table, the metric counts it once
    assert any("TRUNCATE" in r.getMessage() and logical.name in r.getMessage() for r in caplog.records)
    assert otel.total("dbfanout.truncates", table=f"public.{logical.name}") == counted + 1
    # And the checkpoint moved past it with the truncate recorded (status reads it)
    snap = store.load()
    assert snap is not None
    note = snap.doc.checkpoint.metadata[SOURCE_NOTES]["truncate"]
    assert note["tables"] == [f"public.{logical.name}"] and note["count"] == 1
    # And a second truncate after a row counts on; the row arrives; the first is not counted twice
    logical.insert([3])
    logical.sql("TRUNCATE {t}")
    drain(logical.config, PgLogicalSource(logical.config), store, sink)
    snap = store.load()
    assert snap is not None and snap.doc.checkpoint.metadata[SOURCE_NOTES]["truncate"]["count"] == 2
    assert [e.pk["id"] for e in events_of(sink.accepted)] == [1, 2, 3]


def test_a_change_of_a_relation_not_in_tables_is_a_warning_naming_it(
    logical: LogicalTable, caplog: pytest.LogCaptureFixture
) -> None:
    otel.install()
    other = f"{logical.name}_other"
    logical.sql(f"CREATE TABLE {other} (id INTEGER PRIMARY KEY)")
    try:
        # Given a table someone added to the poller's publication by hand
        logical.sql(f"ALTER PUBLICATION {logical.config.publication} ADD TABLE {other}")
        counted = otel.total("dbfanout.pg_logical.unknown_relation_changes", relation=f"public.{other}")
        # When it changes and the poller drains
        logical.sql(f"INSERT INTO {other} VALUES (1), (2)")
        logical.insert([5])
        store, sink = MemoryStateStore("p"), RecordingSink()
        with caplog.at_level(logging.WARNING):
            drain(logical.config, PgLogicalSource(logical.config), store, sink)
        # Then its changes are not delivered, but a WARNING names the relation and the metric counts them
        assert [e.pk["id"] for e in events_of(sink.accepted)] == [5]
        assert any(f"public.{other}" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
        assert otel.total("dbfanout.pg_logical.unknown_relation_changes", relation=f"public.{other}") == counted + 2
    finally:
        logical.sql(f"DROP TABLE IF EXISTS {other}")


def test_a_truncate_alone_on_a_new_slot_moves_the_checkpoint_with_its_note(logical: LogicalTable) -> None:
    # Given a new slot whose first change is a TRUNCATE (no row to deliver, no checkpoint yet)
    logical.sql("TRUNCATE {t}")
    store, sink = MemoryStateStore("p"), RecordingSink()
    # When the poller drains twice (the second tick reads the slot again from where it stands)
    drain(logical.config, PgLogicalSource(logical.config), store, sink)
    drain(logical.config, PgLogicalSource(logical.config), store, sink)
    # Then a checkpoint was written at the TRUNCATE with its note, counted once, and nothing was sent
    snap = store.load()
    assert snap is not None and snap.doc.checkpoint.position is not None
    note = snap.doc.checkpoint.metadata[SOURCE_NOTES]["truncate"]
    assert note["count"] == 1 and snap.doc.checkpoint.position.cursor == int(note["key"][0])
    assert sink.accepted == []

"""The outbox source on SQLite, PostgreSQL and MariaDB: every change, in commit order, nothing lost.

Real databases, the real tick, the in-memory state store (its contract is tested against the
blob store) and a recording sink.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import sqlalchemy as sa

from poller.sources.factory import open_source
from poller.sources.outbox import OutboxSource
from poller.state.memory import MemoryStateStore
from poller.tick.events import to_batch
from poller.tick.lifecycle import run_tick
from shared.errors import ConfigError, SourceError
from shared.models import Checkpoint
from shared.outbox import write_change
from tests.poller.outbox_support import Outbox, changes, outbox_poller, tick_until_caught_up
from tests.poller.tick_support import RecordingSink
from tests.support.databases import unique_name


@pytest.fixture
def outbox(any_db_url: str) -> Iterator[Outbox]:
    box = Outbox(any_db_url)
    yield box
    box.drop()


def test_a_hard_delete_and_every_intermediate_update_arrive_in_order(outbox: Outbox) -> None:
    poller = outbox_poller(str(outbox.engine.url), outbox.name)
    source, store, sink = open_source(poller), MemoryStateStore(poller.name), RecordingSink()
    assert isinstance(source, OutboxSource)
    # Given an insert, delivered
    outbox.write("42", "insert", {"status": "new"})
    outbox.settled()
    tick_until_caught_up(poller, source, store, sink)
    # When the row is updated three times and then hard-deleted between two ticks
    for status in ("paid", "packed", "shipped"):
        outbox.write("42", "update", {"status": status})
    outbox.write("42", "delete")
    outbox.settled()
    tick_until_caught_up(poller, source, store, sink)
    # Then every change arrived, in commit order, the delete as op "delete"
    assert changes(sink) == [
        ("42", "insert", "upsert", {"status": "new"}),
        ("42", "update", "upsert", {"status": "paid"}),
        ("42", "update", "upsert", {"status": "packed"}),
        ("42", "update", "upsert", {"status": "shipped"}),
        ("42", "delete", "delete", {}),
    ]
    # And the event cursor is the outbox id, so event ids differ per change
    events = [e for b in sink.accepted for e in b.events]
    assert [e.cursor for e in events] == outbox.ids()
    assert len({e.event_id for e in events}) == 5
    # And every event names the outbox table it came from
    assert {e.table for e in events} == {poller.table}


def test_event_ids_and_batch_ids_are_stable_across_redeliveries(outbox: Outbox) -> None:
    poller = outbox_poller(str(outbox.engine.url), outbox.name)
    for i in range(5):
        outbox.write(str(i), "order.created", {"n": i, "nested": {"a": [1, 2]}})
    outbox.settled()
    first = open_source(poller).fetch(None, 10)
    again = open_source(poller).fetch(None, 10)  # another process, after a crash
    one, two = to_batch(poller, "fp", first.rows), to_batch(poller, "fp", again.rows)
    assert one.batch_id == two.batch_id
    assert [e.event_id for e in one.events] == [e.event_id for e in two.events]
    assert one.events[0].after == {"n": 0, "nested": {"a": [1, 2]}}


def test_a_batch_of_many_changes_pages_across_ticks_in_order(outbox: Outbox) -> None:
    poller = outbox_poller(str(outbox.engine.url), outbox.name, batch_size=7, max_batches_per_tick=2)
    with outbox.engine.begin() as conn:  # one transaction, 60 changes of 6 aggregates
        for i in range(60):
            write_change(conn, outbox.name, aggregate=str(i % 6), type="update", payload={"seq": i})
    outbox.settled()
    source, store, sink = open_source(poller), MemoryStateStore(poller.name), RecordingSink()
    tick_until_caught_up(poller, source, store, sink)
    assert [after["seq"] for *_, after in changes(sink)] == list(range(60))


def test_pruning_never_deletes_a_row_the_landed_checkpoint_does_not_cover(outbox: Outbox) -> None:
    poller = outbox_poller(
        str(outbox.engine.url), outbox.name, batch_size=4, max_batches_per_tick=1, outbox_retention_seconds=0
    )
    for i in range(10):
        outbox.write(str(i), "insert", {"i": i})
    source, store, written = open_source(poller), MemoryStateStore(poller.name), outbox.settled().ids()
    # When one tick delivers and commits only the first page (4 rows)
    run_tick(poller, source, store, RecordingSink(), owner_id="a")
    # Then exactly those 4 were pruned at the end of the tick; the 6 unconsumed rows are all there
    remaining = outbox.ids()
    assert remaining == written[4:]
    # When a sink refuses the next page: nothing landed, nothing more is pruned
    with pytest.raises(Exception, match="injected"):
        run_tick(poller, source, store, RecordingSink(fail_next=1), owner_id="a")
    assert outbox.ids() == remaining
    # When everything is delivered: all covered rows go, but the newest row stays (auto-increment)
    sink = RecordingSink()
    tick_until_caught_up(poller, source, store, sink)
    for _ in range(3):  # each tick prunes what the previous ones landed
        run_tick(poller, source, store, sink, owner_id="a")
    assert outbox.ids() == written[-1:]
    assert [after["i"] for *_, after in changes(sink)] == list(range(4, 10))


def test_retention_keeps_delivered_rows_until_they_are_old_enough(outbox: Outbox) -> None:
    poller = outbox_poller(str(outbox.engine.url), outbox.name, outbox_retention_seconds=3600)
    for i in range(5):
        outbox.write(str(i), "insert")
    source = open_source(poller)
    outbox.settled()
    tick_until_caught_up(poller, source, MemoryStateStore(poller.name), RecordingSink())
    assert len(outbox.ids()) == 5


def test_acknowledge_prunes_only_up_to_the_checkpoint_it_is_given(outbox: Outbox) -> None:
    poller = outbox_poller(str(outbox.engine.url), outbox.name, outbox_retention_seconds=0)
    for i in range(6):
        outbox.write(str(i), "insert")
    source, written = open_source(poller), outbox.settled().ids()
    page = source.fetch(None, 3)
    source.acknowledge(Checkpoint(position=page.last))
    assert outbox.ids() == written[3:]
    source.acknowledge(Checkpoint(position=source.fetch(page.last, 10).last))
    assert outbox.ids() == written[-1:]  # all covered, but the newest row stays


def test_a_missing_outbox_table_or_column_is_a_config_error_with_the_ddl(any_db_url: str) -> None:
    poller = outbox_poller(any_db_url, "no_such_outbox_table")
    with pytest.raises(ConfigError, match="does not exist"):
        open_source(poller).fetch(None, 10)
    box = Outbox(any_db_url)
    try:
        with box.engine.begin() as conn:
            conn.exec_driver_sql(f"ALTER TABLE {box.name} RENAME COLUMN aggregate TO agg")
        with pytest.raises(ConfigError, match="lacks column") as info:
            open_source(outbox_poller(any_db_url, box.name)).fetch(None, 10)
        assert "CREATE TABLE" in str(info.value.hint)
    finally:
        box.drop()


def test_a_payload_that_is_not_an_object_fails_loudly(outbox: Outbox) -> None:
    with outbox.engine.begin() as conn:
        conn.execute(
            sa.text(f"INSERT INTO {outbox.name} (aggregate, type, payload) VALUES ('1', 'x', '[1, 2]')")
            if outbox.engine.dialect.name != "postgresql"
            else sa.text(f"INSERT INTO {outbox.name} (aggregate, type, payload) VALUES ('1', 'x', '[1, 2]'::jsonb)")
        )
    outbox.settled()
    page = open_source(outbox_poller(str(outbox.engine.url), outbox.name)).fetch(None, 10)
    with pytest.raises(SourceError, match="JSON object"):
        _ = page.rows


def test_write_change_checks_its_arguments(outbox: Outbox) -> None:
    with outbox.engine.begin() as conn:
        with pytest.raises(ValueError, match="aggregate"):
            write_change(conn, outbox.name, aggregate="", type="insert")
        with pytest.raises(TypeError, match="mapping"):
            write_change(conn, outbox.name, aggregate="1", type="insert", payload=[1])  # type: ignore[arg-type]


def test_write_change_joins_an_orm_sessions_transaction(outbox: Outbox) -> None:
    from sqlalchemy.orm import Session

    with Session(outbox.engine) as session:
        write_change(session, outbox.name, aggregate=7, type="order.shipped", payload={"at": "now"})
        session.rollback()  # nothing committed: the change goes with the business write or not at all
        write_change(session, outbox.name, aggregate=7, type="order.shipped", payload={"at": "now"})
        session.commit()
    (row,) = open_source(outbox_poller(str(outbox.engine.url), outbox.settled().name)).fetch(None, 10).rows
    assert row.values == {"at": "now"} and row.event is not None and row.event.pk == {"aggregate": "7"}


def test_describe_names_a_missing_index_of_the_outbox_read(outbox: Outbox) -> None:
    poller = outbox_poller(str(outbox.engine.url), outbox.name)
    assert OutboxSource(poller).describe()["index_warning"] is None
    horizon = outbox.engine.dialect.name == "postgresql"
    index = f"ix_{outbox.name}_txid" if horizon else f"ix_{outbox.name}_created"
    on_table = f" ON {outbox.name}" if outbox.engine.dialect.name in ("mysql", "mariadb") else ""
    with outbox.engine.begin() as conn:
        conn.exec_driver_sql(f"DROP INDEX {index}{on_table}")
    warning = OutboxSource(poller).describe()["index_warning"]
    assert warning is not None and ("txid, id" if horizon else "created_at") in warning


def test_create_missing_makes_the_table_and_index_once(any_db_url: str) -> None:
    name = unique_name("outbox")
    source = OutboxSource(outbox_poller(any_db_url, name))
    try:
        assert source.create_missing()[0] == f"table {name}"
        assert source.create_missing() == []
        assert source.describe()["index_warning"] is None and len(source.fetch(None, 10)) == 0
    finally:
        engine = sa.create_engine(any_db_url)
        with engine.begin() as conn:
            conn.exec_driver_sql(f"DROP TABLE IF EXISTS {name}")
        engine.dispose()

"""kind = "pg_logical": every change from a replication slot, through the real tick (PostgreSQL).

Each test has its own table, publication and slot (dropped even on failure). The state store is
the in-memory fake (its CAS contract is the blob store's); the crash tests in
test_pg_logical_crash.py use the blob store on Azurite and a real SIGKILL.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import pytest

from poller.sources.pg_logical.source import PgLogicalSource
from poller.state.memory import MemoryStateStore
from poller.tick.lifecycle import run_tick
from shared.codec import decode_state, encode_state
from shared.models import Lsn
from tests.poller.pg_logical_support import LogicalTable, events_of, logical_table, summary
from tests.poller.tick_support import RecordingSink, drain

pytestmark = pytest.mark.integration


@pytest.fixture
def logical(pg_logical_url: str) -> Iterator[LogicalTable]:
    with logical_table(pg_logical_url) as table:
        yield table


def _drain(table: LogicalTable, store: MemoryStateStore, sink: RecordingSink) -> None:
    drain(table.config, PgLogicalSource(table.config), store, sink)


def test_a_hard_delete_arrives_with_its_old_key(logical: LogicalTable) -> None:
    # Given two rows delivered
    store, sink = MemoryStateStore("p"), RecordingSink()
    logical.insert([1, 2], "a")
    _drain(logical, store, sink)
    # When one is hard-deleted
    logical.sql("DELETE FROM {t} WHERE id = 1")
    _drain(logical, store, sink)
    # Then the handler gets op delete with the pk, no after, and the old key as before
    events = events_of(sink.accepted)
    assert summary(events) == [("insert", 1, "a"), ("insert", 2, "a"), ("delete", 1, None)]
    delete = events[-1]
    assert (delete.op, delete.pk, delete.after, delete.before) == ("delete", {"id": 1}, None, {"id": 1})
    assert {e.op for e in events[:2]} == {"upsert"}
    # and every event, the delete included, names its schema-qualified table
    assert {e.table for e in events} == {f"public.{logical.name}"}


def test_replica_identity_full_brings_the_old_row_on_delete_and_update(logical: LogicalTable) -> None:
    # Given REPLICA IDENTITY FULL and a row
    logical.sql("ALTER TABLE {t} REPLICA IDENTITY FULL")
    logical.insert([1], "a")
    # When it is updated, then deleted
    logical.sql("UPDATE {t} SET v = 'b' WHERE id = 1")
    logical.sql("DELETE FROM {t} WHERE id = 1")
    store, sink = MemoryStateStore("p"), RecordingSink()
    _drain(logical, store, sink)
    # Then the update and the delete carry the whole old row
    _, update, delete = events_of(sink.accepted)
    assert update.before == {"id": 1, "v": "a", "n": 0} and update.after == {"id": 1, "v": "b", "n": 0}
    assert delete.before == {"id": 1, "v": "b", "n": 0} and delete.after is None


def test_three_updates_between_ticks_all_arrive_in_commit_order(logical: LogicalTable) -> None:
    # Given a row delivered
    store, sink = MemoryStateStore("p"), RecordingSink()
    logical.insert([7], "v0")
    _drain(logical, store, sink)
    # When it is updated three times (three transactions) before the next tick
    for v in ("v1", "v2", "v3"):
        logical.sql(f"UPDATE {{t}} SET v = '{v}' WHERE id = 7")
    _drain(logical, store, sink)
    # Then every intermediate state arrives, in order, each with its own event id
    events = events_of(sink.accepted)
    assert summary(events) == [("insert", 7, "v0"), ("update", 7, "v1"), ("update", 7, "v2"), ("update", 7, "v3")]
    assert len({e.event_id for e in events}) == 4
    assert [e.cursor for e in events] == sorted(e.cursor for e in events)


def test_an_update_that_changes_the_key_carries_the_old_key(logical: LogicalTable) -> None:
    logical.insert([1], "a")
    logical.sql("UPDATE {t} SET id = 10 WHERE id = 1")
    store, sink = MemoryStateStore("p"), RecordingSink()
    _drain(logical, store, sink)
    update = events_of(sink.accepted)[-1]
    assert (update.change, update.pk, update.before) == ("update", {"id": 10}, {"id": 1})


@pytest.mark.parametrize("depth", [1, 16], ids=["inline-commits", "pipelined-commits"])
def test_a_10k_row_transaction_is_split_across_pages_and_ticks(logical: LogicalTable, depth: int) -> None:
    # Given one transaction of 10,000 rows, pages of 500 and 4 pages a tick (commits inline or pipelined)
    logical.insert(range(10_000), "big")
    logical.insert([10_000], "after")  # a later transaction
    store, sink = MemoryStateStore("p"), RecordingSink()
    config = replace(logical.config, batch_size=500, max_batches_per_tick=4, max_uncommitted_batches=depth)
    source = PgLogicalSource(config)
    source.MAX_DECODED = 1200  # a peek decodes the big transaction in parts, as a bulk load would be
    # When ticking: the first tick stops inside the transaction (2,000 of 10,000)
    first = run_tick(config, source, store, sink, owner_id="a")
    assert (first.stop_reason, first.rows) == ("max_batches", 2000)
    snap = store.load()
    assert snap is not None and snap.doc.checkpoint.position is not None
    mid = snap.doc.checkpoint.position
    assert isinstance(mid.cursor, Lsn) and mid.pk == {"seq": 1999}
    # the checkpoint round-trips as a pg_lsn cursor; the slot keeps the unfinished transaction
    assert decode_state(encode_state(snap.doc)).checkpoint.position == mid
    assert b'"kind":"pg_lsn"' in encode_state(snap.doc)
    assert logical.confirmed_flush() <= mid.cursor
    results = drain(config, source, store, sink)
    # Then every row arrives exactly once, in transaction order, and the slot moved past it all
    events = events_of(sink.accepted)
    assert [e.pk["id"] for e in events] == list(range(10_001))
    assert sum(len(b.events) for b in sink.accepted) == 10_001  # no re-sends without a crash
    assert sum(r.rows for r in results) + first.rows == 10_001
    last = store.load()
    assert last is not None and last.doc.checkpoint.position is not None
    assert logical.confirmed_flush() > int(last.doc.checkpoint.position.cursor)  # type: ignore[arg-type]


def test_a_column_added_mid_stream_appears_from_that_change_on(logical: LogicalTable) -> None:
    store, sink = MemoryStateStore("p"), RecordingSink()
    logical.insert([1], "before-alter")
    _drain(logical, store, sink)
    # When a column is added between changes already in the slot
    logical.insert([2], "old-shape")
    logical.sql("ALTER TABLE {t} ADD COLUMN extra TEXT DEFAULT 'dflt'")
    logical.sql("INSERT INTO {t} (id, v, n, extra) VALUES (3, 'new-shape', 0, 'e3')")
    logical.sql("UPDATE {t} SET v = 'touched' WHERE id = 1")
    _drain(logical, store, sink)
    # Then changes before the ALTER have the old columns, later ones the new column
    events = events_of(sink.accepted)
    assert [dict(e.after or {}) for e in events[1:]] == [
        {"id": 2, "v": "old-shape", "n": 0},
        {"id": 3, "v": "new-shape", "n": 0, "extra": "e3"},
        {"id": 1, "v": "touched", "n": 0, "extra": "dflt"},
    ]


@pytest.mark.parametrize("identity", ["default", "full"])
def test_toasted_values_arrive_and_an_unchanged_one_is_not_invented(logical: LogicalTable, identity: str) -> None:
    # Given a row with a large, incompressible value (stored out of line: TOAST)
    if identity == "full":
        logical.sql("ALTER TABLE {t} REPLICA IDENTITY FULL")
    big = "".join(f"{i:08x}" for i in range(40_000))  # 320 KB of hex digits
    logical.sql("ALTER TABLE {t} ALTER COLUMN v SET STORAGE EXTERNAL")
    logical.sql("INSERT INTO {t} (id, v, n) VALUES (1, :big, 0)", params={"big": big})
    # When another column is updated (the TOASTed value is unchanged, so the log does not repeat it)
    logical.sql("UPDATE {t} SET n = 1 WHERE id = 1")
    store, sink = MemoryStateStore("p"), RecordingSink()
    _drain(logical, store, sink)
    insert, update = events_of(sink.accepted)
    # Then the insert has the whole value; the update has it from the old row (FULL) or leaves it out
    assert insert.after is not None and insert.after["v"] == big
    assert update.after is not None and update.after["n"] == 1
    if identity == "full":
        assert update.after["v"] == big
    else:
        assert "v" not in update.after  # never a placeholder: absent means "unchanged"


def test_an_idle_slot_is_advanced_past_other_tables_writes(logical: LogicalTable) -> None:
    # Given everything delivered, and then writes to a table the slot does not publish
    store, sink = MemoryStateStore("p"), RecordingSink()
    logical.insert([1])
    _drain(logical, store, sink)
    logical.sql("CREATE TEMP TABLE other_writes (x int)", "INSERT INTO other_writes VALUES (1)")
    logical.sql("CREATE TABLE {t}_other (x int)", "INSERT INTO {t}_other VALUES (1)", "DROP TABLE {t}_other")
    before = logical.confirmed_flush()
    # When a tick finds nothing new
    _drain(logical, store, sink)
    # Then the slot moved on anyway (it does not hold WAL back), and nothing was re-sent
    assert logical.confirmed_flush() > before
    assert len(sink.accepted) == 1


def test_a_published_truncate_is_skipped_and_the_changes_around_it_arrive(logical: LogicalTable) -> None:
    # Given a publication that (unlike the one validate --fix creates) also publishes TRUNCATE
    logical.sql(f"ALTER PUBLICATION {logical.config.publication} SET (publish = 'insert, update, delete, truncate')")
    logical.insert([1], "a")
    logical.sql("TRUNCATE {t}")
    logical.insert([2], "b")
    store, sink = MemoryStateStore("p"), RecordingSink()
    # When the poller reads past it; Then the truncate (which has no rows) is not an event
    _drain(logical, store, sink)
    assert summary(events_of(sink.accepted)) == [("insert", 1, "a"), ("insert", 2, "b")]

"""Snapshots beside the stream (poller/snapshot/chunks.py): DBLog's watermarks against a real PostgreSQL.

The guarantee: after a snapshot completes, the target rebuilt from every event (de-duplicated by
event id, in delivery order) equals the source, whatever was inserted, updated or deleted during
it; a snapshot row never arrives after a newer change of its key, and a key deleted meanwhile is
not resurrected. The worst interleavings are forced, not hoped for: writes are made between a
chunk's select and the commit of its high watermark (a reader whose watermark commit first runs
them), and between the fetches and ticks (while a chunk's pages are being sent).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from poller.snapshot.chunks import Chunk
from poller.snapshot.postgres import ChunkReader, request_statement
from poller.sources.pg_logical.source import PgLogicalSource
from poller.state.memory import MemoryStateStore
from poller.tick.lifecycle import run_tick
from shared.codec import decode_state, encode_state
from shared.config import PollerConfig
from shared.errors import CommitError
from shared.models import RowChange
from tests.poller.pg_logical_support import LogicalTable, events_of, logical_table, poller_config
from tests.poller.tick_support import RecordingSink, drain
from tests.support import otel
from worker.idempotency import ProcessedEvents

pytestmark = pytest.mark.integration


@pytest.fixture
def logical(pg_logical_url: str) -> Iterator[LogicalTable]:
    with logical_table(pg_logical_url) as table:
        yield table


def _config(table: LogicalTable, **more: Any) -> PollerConfig:
    return poller_config(table.url, table.name, signal_table=table.config.signal_table, **more)


def rebuild(events: list[RowChange]) -> dict[int, tuple[Any, Any]]:
    """The target a handler keeps: every event applied in delivery order (first copy of an id wins)."""
    target: dict[int, tuple[Any, Any]] = {}
    for e in events:
        key = e.pk["id"]
        if e.op == "delete":
            target.pop(key, None)
        else:
            assert e.after is not None
            target[key] = (e.after["v"], e.after["n"])
    return target


def source_rows(table: LogicalTable) -> dict[int, tuple[Any, Any]]:
    with table.engine.connect() as conn:
        return {r.id: (r.v, r.n) for r in conn.execute(sa.text(f"SELECT id, v, n FROM {table.name}"))}


class WriterBetween(ChunkReader):
    """The real chunk reader, with writes made between each chunk's select and the commit of its high
    watermark (the window DBLog exists for): ``writes`` is called with the chunk's number."""

    def __init__(self, config: PollerConfig, engine: sa.Engine, writes: Callable[[int], None]) -> None:
        super().__init__(config, engine)
        self.writes, self.chunks = writes, 0

    def commit_watermark(self, conn: sa.Connection, chunk: Chunk) -> None:
        self.writes(self.chunks)
        self.chunks += 1
        super().commit_watermark(conn, chunk)


def _source(config: PollerConfig, writes: Callable[[int], None] | None = None) -> PgLogicalSource:
    source = PgLogicalSource(config)
    if writes is not None:
        source._chunks = WriterBetween(config, source._engine, writes)
    return source


def test_an_initial_snapshot_delivers_every_existing_row_once_then_streams(logical: LogicalTable) -> None:
    # Given 120 rows that existed before the slot (snapshot = "initial", chunks of 25)
    logical.drop_slot()
    logical.insert(range(120), "old")
    logical.create_slot()
    config = _config(logical, snapshot="initial", snapshot_chunk_size=25)
    store, sink = MemoryStateStore("p"), RecordingSink()
    # When the poller drains, then a row is updated and another deleted
    drain(config, _source(config), store, sink)
    logical.sql("UPDATE {t} SET v = 'new' WHERE id = 3", "DELETE FROM {t} WHERE id = 4")
    drain(config, _source(config), store, sink)
    # Then every existing row came once as a "read" (op upsert) naming its table, then the changes
    events = events_of(sink.accepted)
    reads = [e for e in events if e.change == "read"]
    assert sorted(e.pk["id"] for e in reads) == list(range(120))
    assert {(e.op, e.table) for e in reads} == {("upsert", f"public.{logical.name}")}
    assert [(e.change, e.pk["id"]) for e in events[-2:]] == [("update", 3), ("delete", 4)]
    assert rebuild(events) == source_rows(logical)
    # And the state blob says the snapshot finished, with its counts (and round-trips)
    snap = store.load()
    assert snap is not None and snap.doc.checkpoint.position is not None
    state = snap.doc.checkpoint.position.snapshot
    assert state is not None and not state.active and state.rows == 120 and state.chunks == 5
    assert decode_state(encode_state(snap.doc)) == snap.doc


def test_never_is_the_default_and_delivers_only_changes(logical: LogicalTable) -> None:
    logical.drop_slot()
    logical.insert(range(5), "old")
    logical.create_slot()
    config = _config(logical)
    store, sink = MemoryStateStore("p"), RecordingSink()
    logical.insert([100], "new")
    drain(config, _source(config), store, sink)
    assert [(e.change, e.pk["id"]) for e in events_of(sink.accepted)] == [("insert", 100)]
    snap = store.load()
    assert snap is not None and snap.doc.checkpoint.position is not None
    assert snap.doc.checkpoint.position.snapshot is None  # the blob is written as before


def test_keys_changed_between_a_chunks_select_and_its_watermark_are_never_stale_nor_resurrected(
    logical: LogicalTable,
) -> None:
    # Given 60 rows and chunks of 20
    logical.drop_slot()
    logical.insert(range(60), "old")
    logical.create_slot()
    config = _config(logical, snapshot="initial", snapshot_chunk_size=20)

    def writes(chunk: int) -> None:
        # After each select, before its watermark: update, delete and re-insert keys of that chunk
        base = chunk * 20
        logical.sql(
            f"UPDATE {{t}} SET v = 'upd{chunk}', n = n + 1 WHERE id = {base + 1}",
            f"DELETE FROM {{t}} WHERE id = {base + 2}",
            f"DELETE FROM {{t}} WHERE id = {base + 3}",
            f"INSERT INTO {{t}} (id, v, n) VALUES ({base + 3}, 'again', 7)",
            f"INSERT INTO {{t}} (id, v, n) VALUES ({1000 + chunk}, 'fresh', 0)",
        )

    store, sink = MemoryStateStore("p"), RecordingSink()
    drain(config, _source(config, writes), store, sink)
    events = events_of(sink.accepted)
    # Then the target equals the source: the deleted keys stay deleted, the updates are not undone
    assert rebuild(events) == source_rows(logical)
    # and no snapshot row of a key comes after a change of that key made during its window
    for chunk in range(3):
        changed = [e for e in events if e.pk["id"] in (chunk * 20 + 1, chunk * 20 + 2, chunk * 20 + 3)]
        assert all(e.change != "read" for e in changed), [(e.change, e.pk) for e in changed]


def test_a_key_changed_after_the_watermark_leaves_the_rest_of_its_chunk(logical: LogicalTable) -> None:
    # Given chunks of 20 sent in pages of 5, one page a tick: a chunk outlives its watermark
    logical.drop_slot()
    logical.insert(range(40), "old")
    logical.create_slot()
    config = _config(logical, snapshot="initial", snapshot_chunk_size=20, batch_size=5, max_batches_per_tick=1)
    store, sink, source = MemoryStateStore("p"), RecordingSink(), _source(config)
    run_tick(config, source, store, sink, owner_id="a")
    assert [e.pk["id"] for e in events_of(sink.accepted)] == [0, 1, 2, 3, 4]
    # When rows of the chunk not yet sent change after its watermark was read
    logical.sql("UPDATE {t} SET v = 'late' WHERE id = 12", "DELETE FROM {t} WHERE id = 15")
    drain(config, source, store, sink, max_ticks=100)
    events = events_of(sink.accepted)
    # Then those keys come only as their changes (the chunk's copies would be older, or resurrect
    # a deleted row), and the target equals the source
    assert [(e.change, e.pk["id"]) for e in events if e.pk["id"] in (12, 15)] == [("update", 12), ("delete", 15)]
    assert sorted(e.pk["id"] for e in events if e.change == "read") == sorted(set(range(40)) - {12, 15})
    assert rebuild(events) == source_rows(logical)


def test_changes_made_during_a_snapshot_go_out_before_the_rest_of_its_chunk_in_the_same_tick(
    logical: LogicalTable,
) -> None:
    # Given a snapshot whose first page of a chunk of 20 went out (pages of 10)
    logical.drop_slot()
    logical.insert(range(40), "old")
    logical.create_slot()
    config = _config(logical, snapshot="initial", snapshot_chunk_size=20, batch_size=10, max_batches_per_tick=1)
    store, sink, source = MemoryStateStore("p"), RecordingSink(), _source(config)
    run_tick(config, source, store, sink, owner_id="a")
    # When a row is inserted and the next tick may send many pages
    logical.insert([1000], "live")
    result = run_tick(config, source, store, next_sink := RecordingSink(), owner_id="a")
    first = events_of(next_sink.accepted)
    # Then the change went first, alone in its page, and the tick went on (not "caught up")
    assert [(e.change, e.pk["id"]) for e in first] == [("insert", 1000)]
    assert result.stop_reason == "max_batches"
    # And a page of the chunk's follows, read from memory (a steady stream does not stall it),
    # then the next change first again, then the rest in the same tick
    many = replace(config, max_batches_per_tick=20)
    logical.insert([1001], "live")
    run_tick(many, source, store, later := RecordingSink(), owner_id="a")
    pages = [[(e.change, e.pk["id"]) for e in batch.events] for batch in later.accepted]
    assert pages[0] == [("read", k) for k in range(10, 20)] and pages[1] == [("insert", 1001)]
    rest_keys = [k for page in pages[2:] for _, k in page]
    # (1000 and 1001 came as inserts; the chunk read ahead may have been selected before them)
    assert rest_keys[:20] == list(range(20, 40)) and set(rest_keys[20:]) <= {1000, 1001}
    assert rebuild([*events_of(sink.accepted), *first, *events_of(later.accepted)]) == source_rows(logical)


def test_a_requested_snapshot_of_a_live_poller_resumes_after_its_last_landed_chunk(logical: LogicalTable) -> None:
    # Given a streaming poller (no initial snapshot) over 50 rows that predate its slot
    logical.drop_slot()
    logical.insert(range(50), "old")
    logical.create_slot()
    config = _config(logical, snapshot_chunk_size=10, max_batches_per_tick=2, batch_size=10)
    store, sink = MemoryStateStore("p"), RecordingSink()
    logical.insert([500], "new")
    drain(config, _source(config), store, sink)
    # When `dbfanout snapshot` queues one (a signal row) and a tick lands two chunks only
    statement, params = request_statement(config, where="id < 45")
    with logical.engine.begin() as conn:
        conn.execute(statement, params)
    run_tick(config, _source(config), store, sink, owner_id="a")
    snap = store.load()
    assert snap is not None and snap.doc.checkpoint.position is not None
    mid = snap.doc.checkpoint.position.snapshot
    assert mid is not None and mid.active and mid.rows == 20 and mid.last_key == {"id": 19}
    # And the process dies; a new one (new source, chunk lost with the old one) goes on
    drain(config, _source(config), store, sink, owner_id="b")
    # Then the rows the condition selects came once, the rest not at all, and the state finished
    reads = [e.pk["id"] for e in events_of(sink.accepted) if e.change == "read"]
    assert sorted(reads) == list(range(45))
    snap = store.load()
    assert snap is not None and snap.doc.checkpoint.position is not None
    done = snap.doc.checkpoint.position.snapshot
    assert done is not None and not done.active and done.rows == 45 and not done.cancelled


def test_a_cancel_stops_a_running_snapshot(logical: LogicalTable) -> None:
    logical.drop_slot()
    logical.insert(range(40), "old")
    logical.create_slot()
    config = _config(logical, snapshot_chunk_size=10, max_batches_per_tick=1, batch_size=10)
    store, sink = MemoryStateStore("p"), RecordingSink()
    statement, params = request_statement(config)
    with logical.engine.begin() as conn:
        conn.execute(statement, params)
    logical.insert([900], "new")  # the request's state lands with a change after it
    run_tick(config, _source(config), store, sink, owner_id="a")
    statement, params = request_statement(config, cancel=True)
    with logical.engine.begin() as conn:
        conn.execute(statement, params)
    logical.insert([901], "new")
    drain(config, _source(config), store, sink)
    reads = [e.pk["id"] for e in events_of(sink.accepted) if e.change == "read"]
    assert len(reads) < 40
    snap = store.load()
    assert snap is not None and snap.doc.checkpoint.position is not None
    state = snap.doc.checkpoint.position.snapshot
    assert state is not None and state.cancelled and not state.active


def _request(table: LogicalTable, config: PollerConfig, **kw: Any) -> str:
    statement, params = request_statement(config, **kw)
    with table.engine.begin() as conn:
        conn.execute(statement, params)
    return str(params["id"])


def _read_ids(sink: RecordingSink) -> dict[int, str]:
    return {e.pk["id"]: e.event_id for e in events_of(sink.accepted) if e.change == "read"}


def test_a_chunk_re_read_within_a_run_keeps_its_ids_and_another_run_gets_new_ones(logical: LogicalTable) -> None:
    # Given a streaming poller over 10 rows that predate its slot, caught up
    logical.drop_slot()
    logical.insert(range(10), "old")
    logical.create_slot()
    config = _config(logical, snapshot_chunk_size=20)
    store = MemoryStateStore("p")
    logical.insert([500], "new")
    drain(config, _source(config), store, RecordingSink())
    # When a snapshot is requested and read, but its checkpoint never lands (the state write fails
    # after the send: the slot is not advanced)
    _request(logical, config)
    landed = store.load()
    assert landed is not None
    first, second, third = RecordingSink(), RecordingSink(), RecordingSink()
    store.fail_next_commit()
    with pytest.raises(CommitError):
        run_tick(config, _source(config), store, first, owner_id="a")
    now = store.load()
    assert first.accepted and now is not None and now.doc.checkpoint == landed.doc.checkpoint
    # And a new process reads the same run again, after one row changed
    logical.sql("UPDATE {t} SET v = 'changed' WHERE id = 5")
    drain(config, _source(config), store, second)
    ids_first, ids_second = _read_ids(first), _read_ids(second)
    # Then within the run an unchanged row version has the same id (duplicate detection absorbs
    # the copy); the changed row (a new version, its update before the chunk) has a new one
    rows = {*range(10), 500}
    assert set(ids_first) == set(ids_second) == rows
    assert {k for k in rows if ids_first[k] == ids_second[k]} == rows - {5}
    assert [(e.change, e.pk["id"]) for e in events_of(second.accepted) if e.change != "read"] == [("update", 5)]
    # And a second snapshot (another run) reads every row again under new ids
    _request(logical, config)
    drain(config, _source(config), store, third)
    ids_third = _read_ids(third)
    assert set(ids_third) == rows
    assert not set(ids_third.values()) & (set(ids_first.values()) | set(ids_second.values()))


def test_a_request_reusing_the_last_runs_id_is_still_a_new_run(logical: LogicalTable) -> None:
    # Given a finished snapshot whose request row was written by hand with id "repair"
    logical.insert(range(5), "old")
    config = _config(logical, snapshot_chunk_size=10)
    store, first, second = MemoryStateStore("p"), RecordingSink(), RecordingSink()
    hand_written = sa.text(
        f"INSERT INTO {config.signal_table} (poller, kind, id, data) VALUES (:p, 'request', 'repair',"
        ' \'{"action": "snapshot"}\') ON CONFLICT (poller, kind) DO UPDATE SET id = EXCLUDED.id,'
        " data = EXCLUDED.data"
    )
    with logical.engine.begin() as conn:
        conn.execute(hand_written, {"p": config.name})
    drain(config, _source(config), store, first)
    # When the same row is written again (same id)
    with logical.engine.begin() as conn:
        conn.execute(hand_written, {"p": config.name})
    drain(config, _source(config), store, second)
    # Then both runs delivered every row, under different ids
    ids_first, ids_second = _read_ids(first), _read_ids(second)
    assert set(ids_first) == set(ids_second) == set(range(5))
    assert not set(ids_first.values()) & set(ids_second.values())


def test_two_snapshots_of_an_unchanged_table_both_reach_an_idempotent_handler(
    logical: LogicalTable, tmp_path: Path
) -> None:
    # Given a live poller and a handler that skips event ids it processed (ProcessedEvents)
    logical.insert(range(30), "old")
    config = _config(logical, snapshot_chunk_size=8, batch_size=10)
    store, sink = MemoryStateStore("p"), RecordingSink()
    target = sa.create_engine(f"sqlite:///{tmp_path / 'target.db'}")
    processed = ProcessedEvents(target)
    handled: list[RowChange] = []

    def handler(batches: list[Any]) -> None:
        with target.begin() as conn:
            for batch in batches:
                handled.extend(processed.fresh(conn, batch.events))

    # When `dbfanout snapshot` runs twice on the unchanged table (each delivery handled as it comes)
    for _ in range(2):
        _request(logical, config)
        done = len(sink.accepted)
        drain(config, _source(config), store, sink)
        handler(sink.accepted[done:])
    target.dispose()
    # Then the second run handed every row to the handler again (on main its ids were the first's)
    reads = [e.pk["id"] for e in handled if e.change == "read"]
    assert sorted(reads) == sorted([*range(30), *range(30)])


OPS = st.lists(
    st.tuples(st.sampled_from(["insert", "update", "delete"]), st.integers(0, 39)),
    max_size=6,
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    during=st.lists(OPS, min_size=8, max_size=8),
    between=st.lists(OPS, min_size=4, max_size=4),
    chunk=st.integers(3, 12),
    batch=st.integers(2, 15),
)
def test_random_interleavings_never_yield_a_stale_or_resurrected_row(
    logical: LogicalTable, during: list[Any], between: list[Any], chunk: int, batch: int
) -> None:
    # Given 30 rows before the slot, and random writes both inside chunk windows and between ticks
    logical.drop_slot()
    logical.sql("DELETE FROM {t}")
    logical.insert(range(30), "old")
    logical.create_slot()
    config = _config(logical, snapshot="initial", snapshot_chunk_size=chunk, batch_size=batch, max_batches_per_tick=2)
    counter = [0]

    def run(ops: list[tuple[str, int]]) -> None:
        for op, key in ops:
            counter[0] += 1
            if op == "insert":
                logical.sql(
                    f"INSERT INTO {{t}} (id, v, n) VALUES ({key}, 'i{counter[0]}', 0) ON CONFLICT (id) DO NOTHING"
                )
            elif op == "update":
                logical.sql(f"UPDATE {{t}} SET v = 'u{counter[0]}', n = n + 1 WHERE id = {key}")
            else:
                logical.sql(f"DELETE FROM {{t}} WHERE id = {key}")

    source = _source(config, lambda n: run(during[n % len(during)]))
    store, sink = MemoryStateStore("p"), RecordingSink()
    # When ticks run with writes between them until the snapshot finished and the log drained
    for ops in between:
        run_tick(config, source, store, sink, owner_id="a")
        run(ops)
    drain(config, source, store, sink, max_ticks=200)
    # Then the target rebuilt from every event equals the source
    assert rebuild(events_of(sink.accepted)) == source_rows(logical)
    snap = store.load()
    assert snap is not None and snap.doc.checkpoint.position is not None
    state = snap.doc.checkpoint.position.snapshot
    assert state is not None and not state.active


def _slot_backlog(logical: LogicalTable, config: PollerConfig) -> int:
    """Messages the slot still holds for the poller's publication (0: it passed everything)."""
    with logical.engine.connect() as conn:
        return int(
            conn.execute(
                sa.text(
                    "SELECT count(*) FROM pg_logical_slot_peek_binary_changes(CAST(:s AS name), NULL, NULL,"
                    " 'proto_version', '1', 'publication_names', :p)"
                ),
                {"s": config.slot, "p": config.publication},
            ).scalar_one()
        )


def _state(store: MemoryStateStore) -> Any:
    snap = store.load()
    assert snap is not None and snap.doc.checkpoint.position is not None
    return snap.doc.checkpoint.position.snapshot


def test_a_cancel_no_change_follows_lands_in_the_same_tick_and_idle_ticks_read_no_chunk(logical: LogicalTable) -> None:
    # Given a requested snapshot that landed one chunk of 10
    logical.drop_slot()
    logical.insert(range(40), "old")
    logical.create_slot()
    config = _config(logical, snapshot_chunk_size=10, max_batches_per_tick=1, batch_size=10)
    store, sink, source = MemoryStateStore("p"), RecordingSink(), _source(config)
    statement, params = request_statement(config)
    with logical.engine.begin() as conn:
        conn.execute(statement, params)
    run_tick(config, source, store, sink, owner_id="a")
    assert len([e for e in events_of(sink.accepted) if e.change == "read"]) == 10

    def watermark() -> object:
        with logical.engine.connect() as conn:
            query = f"SELECT id FROM {config.signal_table} WHERE kind = 'watermark'"
            return conn.execute(sa.text(query)).scalar()

    # (the next chunk that tick read ahead on its thread has written its watermark: else it may land
    # after the cancel below, a change the next tick has not read)
    ahead = source._snapshots._ahead
    if ahead is not None:
        ahead.future.result(timeout=30)

    # When it is cancelled, nothing changes afterwards (no row carries the cancel), and ONE tick runs
    statement, params = request_statement(config, cancel=True)
    with logical.engine.begin() as conn:
        conn.execute(statement, params)
    before = watermark()
    run_tick(config, source, store, sink, owner_id="a")
    # Then the state blob says cancelled after that tick (the same CAS write as a checkpoint), and
    # the slot passed the cancel (nothing of the poller's is left in it)
    state = _state(store)
    assert state is not None and state.cancelled and not state.active
    assert _slot_backlog(logical, config) == 0
    # And later idle ticks read no more rows and no chunk (no watermark written)
    for _ in range(2):
        drain(config, source, store, sink)
    assert len([e for e in events_of(sink.accepted) if e.change == "read"]) == 10
    assert watermark() == before


def test_a_snapshot_of_an_empty_table_finishes_in_the_tick_that_reads_its_request(logical: LogicalTable) -> None:
    # Given a streaming poller over an empty table, caught up
    config = _config(logical, snapshot_chunk_size=10, batch_size=10)
    store, sink, source = MemoryStateStore("p"), RecordingSink(), _source(config)
    logical.insert([1], "x")
    logical.sql("DELETE FROM {t} WHERE id = 1")
    drain(config, source, store, sink)
    # When a snapshot is requested and no other write follows
    statement, params = request_statement(config)
    with logical.engine.begin() as conn:
        conn.execute(statement, params)
    result = run_tick(config, source, store, sink, owner_id="a")
    # Then after one tick the state blob shows it finished (no row read, none sent)
    state = _state(store)
    assert state is not None and not state.active and state.rows == 0 and state.finished_at is not None
    assert state.id == params["id"] and result.rows == 0
    assert _slot_backlog(logical, config) == 0


def test_an_initial_snapshot_of_an_empty_table_lands_on_the_first_tick(logical: LogicalTable) -> None:
    # Given snapshot = "initial" on an empty table, no checkpoint yet and no write at all
    config = _config(logical, snapshot="initial", snapshot_chunk_size=10, batch_size=10)
    store, sink = MemoryStateStore("p"), RecordingSink()
    # When one tick runs
    run_tick(config, _source(config), store, sink, owner_id="a")
    # Then the state blob holds the finished snapshot (a new process will not snapshot again)
    state = _state(store)
    assert state is not None and state.id == "initial" and not state.active and state.rows == 0
    logical.insert([7], "new")
    drain(config, _source(config), store, sink)
    assert [(e.change, e.pk["id"]) for e in events_of(sink.accepted)] == [("insert", 7)]


def test_two_tables_with_the_same_keys_each_keep_their_rows_and_name_their_table(logical: LogicalTable) -> None:
    # Given two tables keyed 0..29 alike, both published, rows before the slot
    other = f"{logical.name}_b"
    logical.drop_slot()
    logical.sql(f"CREATE TABLE {other} (id INTEGER PRIMARY KEY, v TEXT, n INTEGER)")
    try:
        logical.insert(range(30), "a")
        logical.sql(f"INSERT INTO {other} (id, v, n) SELECT g, 'b', 0 FROM generate_series(0, 29) g")
        logical.config = poller_config(
            logical.url, logical.name, tables=[logical.name, other], signal_table=logical.config.signal_table
        )
        logical.create_slot()
        config = replace(logical.config, snapshot="initial", snapshot_chunk_size=10)

        def writes(chunk: int) -> None:
            # Inside every window: change the *other* table's row with a key of this chunk, and
            # delete one of this table's: only the latter may leave the chunk
            logical.sql(f"UPDATE {other} SET v = 'b{chunk}' WHERE id = {chunk % 3 * 10 + 1}")
            logical.sql(f"DELETE FROM {{t}} WHERE id = {chunk % 3 * 10 + 2}")

        store, sink = MemoryStateStore("p"), RecordingSink()
        drain(config, _source(config, writes), store, sink)
        events = events_of(sink.accepted)
        # Then each table rebuilds to its source, every event naming its table
        for table in (logical.name, other):
            mine = [e for e in events if e.table == f"public.{table}"]
            target: dict[int, Any] = {}
            for e in mine:
                if e.op == "delete":
                    target.pop(e.pk["id"], None)
                else:
                    assert e.after is not None
                    target[e.pk["id"]] = e.after["v"]
            with logical.engine.connect() as conn:
                rows = {r.id: r.v for r in conn.execute(sa.text(f"SELECT id, v FROM {table}"))}
            assert target == rows, table
        assert {e.table for e in events} == {f"public.{logical.name}", f"public.{other}"}
    finally:
        logical.drop_slot()
        logical.sql(f"DROP TABLE IF EXISTS {other}")


def _snapshot_state(store: MemoryStateStore) -> Any:
    snap = store.load()
    assert snap is not None and snap.doc.checkpoint.position is not None
    return snap.doc.checkpoint.position.snapshot


@pytest.mark.parametrize(
    "where",
    [
        "id = (SELECT nextval('{t}_canary'))",
        "id > 0) OR (SELECT nextval('{t}_canary')) > 0 OR (id = 1",
        "1=1; SELECT nextval('{t}_canary')",
        "id >= 0 OR nextval('{t}_canary') > 0 -- all",
    ],
)
def test_a_hostile_where_written_to_the_signal_table_fails_its_request_and_nothing_of_it_runs(
    logical: LogicalTable, where: str
) -> None:
    # Given a live poller, and a request with a hostile condition written by other means than the CLI
    logical.insert(range(5), "old")
    logical.sql("CREATE SEQUENCE {t}_canary")
    try:
        config = _config(logical)
        store, sink = MemoryStateStore("p"), RecordingSink()
        _request(logical, config, where=where.format(t=logical.name))
        logical.insert([100], "new")
        # When the poller reads it
        drain(config, _source(config), store, sink)
        # Then the request failed with the reason, no row was read, and the canary was never called
        state = _snapshot_state(store)
        assert state is not None and not state.active and state.error and "where refused" in state.error
        assert {e.change for e in events_of(sink.accepted)} == {"insert"}  # the stream's (the rows came as inserts)
        with logical.engine.connect() as conn:
            assert conn.execute(sa.text(f"SELECT is_called FROM {logical.name}_canary")).scalar() is False
    finally:
        logical.sql("DROP SEQUENCE IF EXISTS {t}_canary")


def test_a_chunk_statement_that_keeps_failing_fails_its_request_after_bounded_tries_and_the_stream_goes_on(
    logical: LogicalTable,
) -> None:
    # Given a request whose condition parses but cannot run (a string against an integer column)
    logical.insert(range(5), "old")
    config = _config(logical)
    store, sink = MemoryStateStore("p"), RecordingSink()
    _request(logical, config, where="n = 'not a number'")
    # When the poller ticks on, with changes coming
    for i in range(6):
        logical.insert([100 + i], "new")
        drain(config, _source(config), store, sink)
        state = _snapshot_state(store)
        if state is not None and not state.active:
            break
    # Then the request failed with the database's reason after a few tries, and every change came
    assert state is not None and not state.active and state.error and "invalid input syntax" in state.error
    assert i <= 3
    assert {e.change for e in events_of(sink.accepted)} == {"insert"}
    assert sorted(e.pk["id"] for e in events_of(sink.accepted)) == [*range(5), *range(100, 101 + i)]


def test_a_snapshot_finishes_while_transactions_are_always_in_flight(logical: LogicalTable) -> None:
    # Given 500 rows and writers that keep transactions in flight, each committing every 10 ms
    # on a connection of its own (how a busy server, or one whose commits wait for a
    # synchronous standby, looks to a chunk's select: a commit not yet visible is often there)
    logical.drop_slot()
    logical.insert(range(500), "old")
    logical.create_slot()
    config = _config(logical, snapshot_chunk_size=100, batch_size=100)
    store, sink = MemoryStateStore("p"), RecordingSink()
    stop = threading.Event()

    def write(first: int) -> None:
        engine = sa.create_engine(logical.url)
        try:
            with engine.connect() as conn:
                n = first
                # A commit every 10 ms (pacing, not a wait): always one in flight somewhere, yet a rate a
                # loaded CI machine's poller keeps up with (a chunk is read once the stream caught up)
                while not stop.wait(0.01):
                    conn.execute(sa.text(f"INSERT INTO {logical.name} (id, v, n) VALUES (:i, 'w', 0)"), {"i": n})
                    conn.commit()
                    n += 1
        finally:
            engine.dispose()

    writers = [threading.Thread(target=write, args=(10_000 * (k + 1),), daemon=True) for k in range(3)]
    for w in writers:
        w.start()
    refused = _refusals()
    try:
        _request(logical, config)
        # When the poller ticks (a bounded number of times: the writers never let it catch up)
        state, source = None, _source(config)
        for _ in range(200):
            run_tick(config, source, store, sink, owner_id="a")
            state = _snapshot_state(store)
            if state is not None and not state.active:
                break
    finally:
        stop.set()
        for w in writers:
            w.join(timeout=10)
    # Then the snapshot finished, every pre-existing row was read, and the refusals were counted
    assert state is not None and not state.active and state.error is None, state
    reads = {e.pk["id"] for e in events_of(sink.accepted) if e.change == "read"}
    assert set(range(500)) <= reads
    assert state.refused == _refusals() - refused  # the state (status) and the metric agree


def _refusals() -> int:
    """The refusals the metric counted so far (for poller p; OpenTelemetry's in-memory reader)."""
    otel.install()
    data = otel.READER.get_metrics_data()
    total = 0.0
    for rm in data.resource_metrics if data else []:
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                if metric.name == "dbfanout.snapshot_chunks_refused":
                    total += sum(
                        getattr(p, "value", 0) for p in metric.data.data_points if p.attributes == {"poller": "p"}
                    )
    return int(total)


class RefusingReader(ChunkReader):
    """The real chunk reader, whose first ``refusals`` selects find a commit not visible yet (what
    a busy server makes common): they are refused exactly as the racy check refuses them."""

    def __init__(self, config: PollerConfig, engine: sa.Engine, refusals: int) -> None:
        super().__init__(config, engine)
        self.refusals, self.limits = refusals, list[int | None]()

    def read(self, conn: sa.Connection, state: Any, start: Any, chunk_id: str | None = None,
             limit: int | None = None) -> Chunk | None:  # fmt: skip
        self.limits.append(limit)
        if self.refusals > 0:
            self.refusals -= 1
            conn.rollback()
            return None
        return super().read(conn, state, start, chunk_id, limit)


def test_refused_chunks_are_retried_with_backoff_and_smaller_chunks_and_the_snapshot_finishes(
    logical: LogicalTable, caplog: pytest.LogCaptureFixture
) -> None:
    # Given a requested snapshot whose chunk selects are refused 25 times in a row
    logical.insert(range(50), "old")
    config = _config(logical, snapshot_chunk_size=40)
    store, sink = MemoryStateStore("p"), RecordingSink()
    source = PgLogicalSource(config)
    reader = source._chunks = RefusingReader(config, source._engine, 25)
    _request(logical, config)
    refused = _refusals()
    # When the poller drains a few times (each drain: one tick)
    state = None
    for _ in range(8):
        drain(config, source, store, sink)
        state = _snapshot_state(store)
        if state is not None and not state.active:
            break
    # Then the snapshot finished (on main a refused chunk waited for the next tick: 25 ticks)
    assert state is not None and not state.active and state.error is None, state
    assert sorted(e.pk["id"] for e in events_of(sink.accepted) if e.change == "read") == list(range(50))
    # And each refusal halved the next read (down to one row), then reads grew back step by step
    assert reader.limits[:7] == [40, 20, 10, 5, 2, 1, 1]
    assert reader.limits[25:28] == [1, 2, 4]
    # And the refusals are in the state (status), in the metric, and said once at WARNING
    assert state.refused == 25 == _refusals() - refused
    warnings = [r for r in caplog.records if r.levelname == "WARNING" and "refused in a row" in r.getMessage()]
    assert len(warnings) == 1

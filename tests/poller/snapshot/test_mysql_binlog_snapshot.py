"""Snapshots of a kind = "mysql_binlog" poller: the same coordinator as pg_logical's, over the binlog (MariaDB).

The guarantee (DBLog's): after a snapshot completes, the target rebuilt from every event (first
copy of an event id wins, in delivery order) equals the source, whatever was written during it; a
snapshot row never arrives after a newer change of its key, and a key deleted meanwhile is not
resurrected. The window's worst case is forced (writes between a chunk's select and its
watermark's commit), and writers run concurrently with the whole snapshot, across restarts.

The server is the ``mysql_binlog_url`` fixture's (a private ``mariadbd`` with the binlog on when
the shared one has it off). Each test has its own tables, poller name and signal table.
"""

from __future__ import annotations

import dataclasses
import random
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from poller.snapshot.chunks import Chunk
from poller.snapshot.mysql import MysqlChunkReader, mysql_request_statement, mysql_signal_sql, quote_mysql, signal_table
from poller.sources.mysql_binlog.source import MysqlBinlogSource
from poller.state.memory import MemoryStateStore
from poller.tick.lifecycle import run_tick
from shared.config import PollerConfig
from shared.models import RowChange, SnapshotState
from tests.poller.mysql_binlog_support import BinlogTables, binlog_tables, events_of, stale_or_resurrected
from tests.poller.tick_support import RecordingSink, drain
from tests.support.databases import unique_name

pytestmark = pytest.mark.integration


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


def _config(tables: BinlogTables, **more: Any) -> PollerConfig:
    """The poller of the fixture's first table only (``id``, ``v``, ``n``)."""
    return dataclasses.replace(tables.config, tables=(tables.qualified,), table=tables.qualified, **more)


class WriterBetween(MysqlChunkReader):
    """The real chunk reader, with writes made after each chunk's select, before its watermark commits."""

    def __init__(self, config: PollerConfig, engine: sa.Engine, writes: Callable[[int], None]) -> None:
        super().__init__(config, engine)
        self.writes, self.chunks = writes, 0

    def commit_watermark(self, conn: sa.Connection, chunk: Chunk) -> None:
        self.writes(self.chunks)
        self.chunks += 1
        super().commit_watermark(conn, chunk)


def _source(config: PollerConfig, writes: Callable[[int], None] | None = None) -> MysqlBinlogSource:
    source = MysqlBinlogSource(config)
    if writes is not None:
        source._snapshots.chunks = WriterBetween(config, source._engine, writes)
    return source


def _rebuild(events: list[RowChange]) -> dict[int, tuple[Any, Any]]:
    target: dict[int, tuple[Any, Any]] = {}
    for e in events:
        if e.change == "delete":
            target.pop(e.pk["id"], None)
        else:
            assert e.after is not None
            target[e.pk["id"]] = (e.after["v"], e.after["n"])
    return target


def _source_rows(tables: BinlogTables) -> dict[int, tuple[Any, Any]]:
    with tables.engine.connect() as conn:
        return {r.id: (r.v, r.n) for r in conn.execute(sa.text(f"SELECT id, v, n FROM {tables.name}"))}


def _state(store: MemoryStateStore) -> SnapshotState | None:
    snap = store.load()
    assert snap is not None and snap.doc.checkpoint.position is not None
    return snap.doc.checkpoint.position.snapshot


def test_an_initial_snapshot_delivers_every_existing_row_once_then_streams(tables: BinlogTables) -> None:
    # Given 120 rows that exist before the poller's first tick (snapshot = "initial", chunks of 25)
    tables.insert(list(range(120)), "old")
    config = _config(tables, snapshot="initial", snapshot_chunk_size=25)
    store, sink, source = MemoryStateStore("p"), RecordingSink(), _source(config)
    # When the poller drains, then a row is updated and another deleted
    drain(config, source, store, sink)
    tables.sql("UPDATE {t} SET v = 'new', n = 1 WHERE id = 5", "DELETE FROM {t} WHERE id = 6")
    drain(config, source, store, sink)
    events = events_of(sink.accepted)
    # Then every row came once as a read (in key order), then the changes, and the target equals the source
    reads = [e for e in events if e.change == "read"]
    assert [e.pk["id"] for e in reads] == list(range(120))
    assert {e.table for e in reads} == {tables.qualified}
    assert [(e.change, e.pk["id"]) for e in events if e.change != "read"] == [("update", 5), ("delete", 6)]
    assert _rebuild(events) == _source_rows(tables)
    state = _state(store)
    assert state is not None and not state.active and state.id == "initial" and state.rows == 120
    assert state.chunks == 5 and state.error is None
    # and the snapshot rows' ids are the run's, table's and row version's (one event per row)
    assert len({e.event_id for e in reads}) == 120


def test_keys_changed_between_a_chunks_select_and_its_watermark_are_never_stale_nor_resurrected(
    tables: BinlogTables,
) -> None:
    # Given 60 rows and chunks of 20, and writes after each chunk's select, before its watermark:
    # an update, a delete, a delete and re-insert of keys of that chunk, and a new key
    tables.insert(list(range(60)), "old")
    config = _config(tables, snapshot="initial", snapshot_chunk_size=20)

    def writes(chunk: int) -> None:
        base = chunk * 20
        tables.sql(
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
    assert _rebuild(events) == _source_rows(tables)
    # and no snapshot row of a key changed inside its window was emitted (the log's change is newer)
    for chunk in range(3):
        changed = [e for e in events if e.pk["id"] in (chunk * 20 + 1, chunk * 20 + 2, chunk * 20 + 3)]
        assert changed and all(e.change != "read" for e in changed), [(e.change, e.pk) for e in changed]
    state = _state(store)
    assert state is not None and not state.active and state.error is None


def test_a_snapshot_under_concurrent_writes_and_restarts_is_never_stale_nor_resurrects(tables: BinlogTables) -> None:
    # Given 400 rows, and three writers, each owning a third of the keys, that update, delete and
    # re-insert them (each write sets n to a version that grows per key) while a requested
    # snapshot runs in chunks of 60, pages of 25, and the poller process is replaced every 4 ticks
    tables.insert(list(range(400)), "old")
    config = _config(tables, snapshot_chunk_size=60, batch_size=25, max_batches_per_tick=4)
    store, sink = MemoryStateStore("p"), RecordingSink()
    drain(config, _source(config), store, sink)  # the first tick: the binlog's end, no snapshot
    stop = threading.Event()
    errors: list[BaseException] = []

    def write(writer: int) -> None:
        rng, version = random.Random(writer), 0
        keys = [k for k in range(420) if k % 3 == writer]
        engine = sa.create_engine(tables.url)
        try:
            with engine.connect() as conn:
                while not stop.wait(0.004):  # pacing (a write every few ms), not a wait for a condition
                    key, op = rng.choice(keys), rng.random()
                    version += 1
                    args = {"k": key, "n": version}
                    if op < 0.6:
                        conn.execute(sa.text(f"UPDATE {tables.name} SET v = 'u', n = :n WHERE id = :k"), args)
                    elif op < 0.8:  # the delete's before image carries its version
                        conn.execute(sa.text(f"UPDATE {tables.name} SET n = :n WHERE id = :k"), args)
                        conn.execute(sa.text(f"DELETE FROM {tables.name} WHERE id = :k"), args)
                    else:
                        conn.execute(
                            sa.text(f"INSERT INTO {tables.name} (id, v, n) VALUES (:k, 'i', :n)"
                                    " ON DUPLICATE KEY UPDATE v = 'i', n = :n"), args,
                        )  # fmt: skip
                    conn.commit()
        except BaseException as exc:  # the test fails on it (a writer must not die silently)
            errors.append(exc)
        finally:
            engine.dispose()

    writers = [threading.Thread(target=write, args=(w,), daemon=True) for w in range(3)]
    for w in writers:
        w.start()
    state: SnapshotState | None = None
    try:
        statement, params = mysql_request_statement(config)
        with tables.engine.begin() as conn:
            conn.execute(statement, params)
        # When the poller ticks (a new process every 4 ticks: the chunk in flight is lost with it)
        source = _source(config)
        for tick in range(400):
            if tick % 4 == 3:
                source.close()
                source = _source(config)
            run_tick(config, source, store, sink, owner_id="a")
            state = _state(store)
            if state is not None and not state.active:
                break
    finally:
        stop.set()
        for w in writers:
            w.join(timeout=10)
    assert not errors, errors
    drain(config, source, store, sink, max_ticks=200)
    source.close()
    events = events_of(sink.accepted)
    # Then the snapshot finished, read rows, and none was stale or resurrected a deleted key
    assert state is not None and not state.active and state.error is None, state
    reads = [e for e in events if e.change == "read"]
    assert reads and state.rows > 0
    assert stale_or_resurrected(events) == []
    # and the target rebuilt from every event equals the source
    assert _rebuild(events) == _source_rows(tables)


def test_a_requested_snapshot_with_a_condition_reads_only_its_rows_and_resumes_after_a_restart(
    tables: BinlogTables,
) -> None:
    # Given a streaming poller (no initial snapshot) over 50 rows that predate it
    tables.insert(list(range(50)), "old")
    config = _config(tables, snapshot_chunk_size=10, batch_size=10, max_batches_per_tick=2)
    store, sink = MemoryStateStore("p"), RecordingSink()
    drain(config, _source(config), store, sink)
    # When `dbfanout snapshot --where "id < 45"` queues one, a tick lands two chunks, and the process dies
    statement, params = mysql_request_statement(config, where="id < 45")
    with tables.engine.begin() as conn:
        conn.execute(statement, params)
    run_tick(config, _source(config), store, sink, owner_id="a")
    mid = _state(store)
    assert mid is not None and mid.active and mid.id == params["id"] and mid.rows == 20 and mid.last_key == {"id": 19}
    drain(config, _source(config), store, sink, owner_id="b")
    # Then the rows the condition selects came once, the rest not at all, and the state finished
    reads = [e.pk["id"] for e in events_of(sink.accepted) if e.change == "read"]
    assert sorted(reads) == list(range(45))
    done = _state(store)
    assert done is not None and not done.active and done.rows == 45 and not done.cancelled


def test_a_cancel_stops_a_running_snapshot_and_other_pollers_signals_are_not_read(tables: BinlogTables) -> None:
    # Given a requested snapshot that landed its first chunk (chunks of 10, one page a tick)
    tables.insert(list(range(40)), "old")
    config = _config(tables, snapshot_chunk_size=10, batch_size=10, max_batches_per_tick=1)
    store, sink, source = MemoryStateStore("p"), RecordingSink(), _source(config)
    drain(config, source, store, sink)
    statement, params = mysql_request_statement(config)
    with tables.engine.begin() as conn:
        conn.execute(statement, params)
    run_tick(config, source, store, sink, owner_id="a")
    # When another poller's request and then this poller's cancel are written
    other = dataclasses.replace(config, name=unique_name("other"))
    for statement, params in (mysql_request_statement(other), mysql_request_statement(config, cancel=True)):
        with tables.engine.begin() as conn:
            conn.execute(statement, params)
    drain(config, source, store, sink)
    # Then the snapshot is cancelled with what it read so far, and the other poller's request did nothing
    state = _state(store)
    assert state is not None and state.cancelled and not state.active
    reads = [e.pk["id"] for e in events_of(sink.accepted) if e.change == "read"]
    assert reads == list(range(len(reads))) and 0 < len(reads) < 40


def _binary_key(i: int) -> bytes:
    """A BINARY(16) key: every other one ends in 0x00 bytes (which the binlog strips)."""
    return i.to_bytes(2, "big") + bytes(range(1, 12)) + (b"\0\0\0" if i % 2 == 0 else b"\x07\x08\x09")


def test_binary_keys_ending_in_zero_bytes_are_matched_by_the_snapshots_drop_rule(tables: BinlogTables) -> None:
    # Given a BINARY(16) keyed table of 40 rows, half of whose keys end in 0x00 (the binlog
    # writes them without those bytes), chunks of 10, and writes after each chunk's select, before
    # its watermark: an update and a delete of keys of that chunk
    table = f"{tables.name}_bin"
    with tables.engine.begin() as conn:
        conn.execute(sa.text(f"CREATE TABLE {table} (id BINARY(16) PRIMARY KEY, v VARCHAR(40), n INT)"))
        conn.execute(sa.text(f"INSERT INTO {table} VALUES (:k, 'old', 0)"), [{"k": _binary_key(i)} for i in range(40)])
    qualified = f"{tables.database}.{table}"
    config = dataclasses.replace(
        tables.config, tables=(qualified,), table=qualified, snapshot="initial", snapshot_chunk_size=10
    )

    def writes(chunk: int) -> None:
        with tables.engine.begin() as conn:
            update, delete = _binary_key(chunk * 10 + 2), _binary_key(chunk * 10 + 4)
            conn.execute(sa.text(f"UPDATE {table} SET v = 'new', n = 1 WHERE id = :k"), {"k": update})
            conn.execute(sa.text(f"DELETE FROM {table} WHERE id = :k"), {"k": delete})

    try:
        store, sink = MemoryStateStore("p"), RecordingSink()
        drain(config, _source(config, writes), store, sink)
        events = events_of(sink.accepted)
        # Then every key arrives as stored (16 bytes), the target equals the table, and no snapshot
        # row of a key changed inside its window was emitted
        assert {len(e.pk["id"]) for e in events} == {16}
        with tables.engine.connect() as conn:
            rows = {r.id: (r.v, r.n) for r in conn.execute(sa.text(f"SELECT id, v, n FROM {table}"))}
        assert _rebuild(events) == rows
        changed = {_binary_key(c * 10 + k) for c in range(4) for k in (2, 4)}
        assert [e.pk["id"] for e in events if e.change == "read" and e.pk["id"] in changed] == []
    finally:
        with tables.engine.begin() as conn:
            conn.execute(sa.text(f"DROP TABLE IF EXISTS {table}"))

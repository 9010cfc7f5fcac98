"""Apply only if newer (worker/ordering.py): stale changes are skipped on every dialect, and
concurrent workers without sessions keep a target equal to its source through a snapshot."""

from __future__ import annotations

import queue
import random
import threading
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any, Literal

import pytest
import sqlalchemy as sa

from poller.sources.pg_logical.source import PgLogicalSource
from poller.state.memory import MemoryStateStore
from poller.tick.lifecycle import run_tick
from shared.models import Batch, RowChange
from tests.poller.pg_logical_support import LogicalTable, logical_table, poller_config
from tests.poller.tick_support import RecordingSink, drain
from tests.support.databases import unique_name
from worker.idempotency import ProcessedEvents
from worker.ordering import LatestVersions


def _event(
    n: int, key: int, cursor: Any, op: Literal["upsert", "delete"] = "upsert", change: str | None = None
) -> RowChange:
    after = None if op == "delete" else {"id": key, "v": f"at {cursor}"}
    return RowChange(f"ev-{n}", op, {"id": key}, cursor, after, "p", change=change)


def test_stale_changes_are_skipped_and_a_delete_is_not_resurrected(
    any_db_url: str, engine_for: Callable[[str], sa.Engine]
) -> None:
    engine = engine_for(any_db_url)
    versions = LatestVersions(engine, unique_name("versions"))
    try:
        # Given an update of key 1 at (20, 0) and a delete of key 2 at (30, 1), applied
        with engine.begin() as conn:
            applied = versions.newer(conn, [_event(1, 1, (20, 0), change="update"), _event(2, 2, (30, 1), "delete")])
        assert [e.event_id for e in applied] == ["ev-1", "ev-2"]
        # When older changes arrive late (a snapshot's read of key 1, an insert of key 2), and newer ones
        with engine.begin() as conn:
            late = versions.newer(conn, [_event(3, 1, (10, 5), change="read"), _event(4, 2, (29, 9), change="insert")])
            newer = versions.newer(conn, [_event(5, 1, (20, 1)), _event(6, 1, (21, 0)), _event(7, 2, (31, 0))])
        # Then the stale ones are skipped; of a batch's changes of one key, only the newest goes
        assert late == []
        assert [e.event_id for e in newer] == ["ev-6", "ev-7"]
        # And a rolled-back transaction forgets what it recorded
        with pytest.raises(RuntimeError), engine.begin() as conn:
            versions.newer(conn, [_event(8, 1, (50, 0))])
            raise RuntimeError("side effect failed")
        with engine.begin() as conn:
            assert [e.event_id for e in versions.newer(conn, [_event(8, 1, (50, 0))])] == ["ev-8"]
    finally:
        versions.table.drop(engine)


def test_a_later_change_whose_cursor_regressed_in_a_new_epoch_is_applied__issue_39(
    any_db_url: str, engine_for: Callable[[str], sa.Engine]
) -> None:
    engine = engine_for(any_db_url)
    versions = LatestVersions(engine, unique_name("versions"))
    uuid_a, uuid_b = "f0000000-0000-0000-0000-00000000000a", "10000000-0000-0000-0000-00000000000b"
    try:
        # Given key 1 updated on server A (GTID source id A sorts after B) and applied, in epoch 0
        with engine.begin() as conn:
            assert len(versions.newer(conn, [_event(1, 1, (uuid_a, 900, 0))])) == 1
            # (stored as before epochs existed: its text has no epoch, and it reads as epoch 0)
            assert versions.newer(conn, [_event(2, 1, (uuid_a, 899, 0))]) == []
        # When after a failover server B's later changes arrive with lower cursors, in epoch 1,
        # a batch holding both epochs of key 2 among them
        later = [replace(_event(3, 1, (uuid_b, 5, 0)), epoch=1), replace(_event(4, 1, (uuid_b, 6, 0)), epoch=1)]
        mixed = [replace(_event(5, 2, (uuid_b, 7, 0)), epoch=1), _event(6, 2, (uuid_a, 901, 0))]
        with engine.begin() as conn:
            applied = versions.newer(conn, later + mixed)
        # Then the later ones are applied (the newest of each key): epoch first, then cursor
        assert [e.event_id for e in applied] == ["ev-4", "ev-5"]
        # And an epoch-0 change redelivered late is skipped, however high its cursor
        with engine.begin() as conn:
            assert versions.newer(conn, [_event(7, 1, (uuid_a, 999, 0))]) == []
            assert versions.newer(conn, [replace(_event(8, 1, (uuid_b, 6, 1)), epoch=1)])[0].event_id == "ev-8"
    finally:
        versions.table.drop(engine)


@pytest.fixture
def logical(pg_logical_url: str) -> Iterator[LogicalTable]:
    with logical_table(pg_logical_url) as table:
        yield table


def _apply(engine: sa.Engine, target: str, events: list[RowChange], versions: LatestVersions | None,
           processed: ProcessedEvents) -> None:  # fmt: skip
    """A replicating handler: upsert or delete each event, in one transaction."""
    with engine.begin() as conn:
        fresh = processed.fresh(conn, events)
        for e in versions.newer(conn, fresh) if versions is not None else fresh:
            conn.execute(sa.text(f"DELETE FROM {target} WHERE id = :id"), {"id": e.pk["id"]})
            if e.op != "delete":
                assert e.after is not None
                conn.execute(sa.text(f"INSERT INTO {target} (id, v, n) VALUES (:id, :v, :n)"), dict(e.after))


def _workers(engine: sa.Engine, batches: list[Batch], guarded: bool, seed: int) -> dict[int, tuple[Any, Any]]:
    """Four workers take the batches in a shuffled order (no sessions: any worker, any order) and
    apply them; the target they leave."""
    target = unique_name("target")
    with engine.begin() as conn:
        conn.execute(sa.text(f"CREATE TABLE {target} (id INTEGER PRIMARY KEY, v TEXT, n INTEGER)"))
    processed = ProcessedEvents(engine, unique_name("processed"))
    versions = LatestVersions(engine, unique_name("versions")) if guarded else None
    work: queue.Queue[Batch] = queue.Queue()
    shuffled = list(batches)
    random.Random(seed).shuffle(shuffled)
    for batch in shuffled:
        work.put(batch)
    errors: list[BaseException] = []

    def worker() -> None:
        while True:
            try:
                batch = work.get_nowait()
            except queue.Empty:
                return
            for _ in range(20):  # a failed transaction (two workers inserting one new key) is retried
                try:
                    _apply(engine, target, list(batch.events), versions, processed)
                    break
                except sa.exc.DBAPIError:
                    continue
            else:
                errors.append(RuntimeError(f"batch {batch.batch_id} kept failing"))

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    try:
        assert not errors, errors
        with engine.connect() as conn:
            return {r.id: (r.v, r.n) for r in conn.execute(sa.text(f"SELECT id, v, n FROM {target}"))}
    finally:
        with engine.begin() as conn:
            conn.execute(sa.text(f"DROP TABLE {target}"))
        processed.table.drop(engine)
        if versions is not None:
            versions.table.drop(engine)


def test_concurrent_workers_without_sessions_keep_the_target_equal_to_the_source(logical: LogicalTable) -> None:
    # Given a snapshot of 60 rows read while they are updated and deleted, in small pages
    logical.drop_slot()
    logical.insert(range(60), "old")
    logical.create_slot()
    more = {"snapshot": "initial", "snapshot_chunk_size": 10, "batch_size": 5, "max_batches_per_tick": 3}
    config = poller_config(logical.url, logical.name, signal_table=logical.config.signal_table, **more)
    store, sink = MemoryStateStore("p"), RecordingSink()
    rng = random.Random(7)
    for round_ in range(12):
        run_tick(config, PgLogicalSource(config), store, sink, owner_id="a")
        keys = rng.sample(range(70), 8)
        logical.sql(*(f"UPDATE {{t}} SET v = 'u{round_}', n = n + 1 WHERE id = {k}" for k in keys[:5]),
                    *(f"DELETE FROM {{t}} WHERE id = {k}" for k in keys[5:7]),
                    f"INSERT INTO {{t}} (id, v, n) VALUES ({100 + round_}, 'new', 0)")  # fmt: skip
    drain(config, PgLogicalSource(config), store, sink)
    batches = [*sink.accepted, *sink.accepted[::3]]  # and a third of them delivered twice
    with logical.engine.connect() as conn:
        source = {r.id: (r.v, r.n) for r in conn.execute(sa.text(f"SELECT id, v, n FROM {logical.name}"))}
    assert any(e.change == "read" for b in batches for e in b.events)
    # When four workers apply them in a shuffled order, with the helper, then without it
    guarded = _workers(logical.engine, batches, True, seed=1)
    naive = _workers(logical.engine, batches, False, seed=1)
    # Then the helper keeps the target equal to the source; without it, stale changes win
    assert guarded == source
    assert naive != source

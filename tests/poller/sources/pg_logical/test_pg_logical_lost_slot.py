"""A replication slot PostgreSQL invalidated (issue 32): the loss made real, then recovered.

Each test loses its slot for real on a private server with ``max_slot_wal_keep_size = 1MB``
(:mod:`tests.poller.lost_slot_support`): the error names the slot, what was lost and the one
command; ``validate --fix`` replaces the slot and requests a snapshot; ``on_lost_position =
"resnapshot"`` does both unattended. "Nothing lost" means: the target rebuilt from every event
equals the table, for every row — the rows changed while the slot was lost included — except a
row *deleted* while it was lost, which no snapshot can report (documented: reconcile the target).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
import sqlalchemy as sa
from azure.functions.timer import TimerRequest

from dbfanout.ops.slot_checks import slot_checks
from dbfanout.ops.status import _slot_source
from poller.functions import _timer
from poller.runtime import PollerRuntime, Runtimes
from poller.sources.pg_logical.slot import LOST_SNAPSHOT_PREFIX
from poller.sources.pg_logical.source import PgLogicalSource
from poller.state.memory import MemoryStateStore
from poller.tick.lifecycle import run_tick
from shared.codec import encode_state
from shared.config import Config, PollerConfig, parse_config
from shared.errors import ConfigError, PositionLostError
from shared.models import Lsn, Position, RowChange
from shared.telemetry import metrics
from tests.poller.lost_slot_support import LOSSY_SETTINGS, lose_slot, wal_status
from tests.poller.pg_logical_support import LogicalTable, events_of, logical_table, poller_config
from tests.poller.tick_support import RecordingSink, drain
from tests.support.private_postgres import start_private_postgres

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def lossy_url() -> Iterator[str]:
    """A private server on which a slot is lost after about one WAL segment (never the shared ones)."""
    with start_private_postgres(LOSSY_SETTINGS) as pg:
        yield pg.url


@pytest.fixture
def logical(lossy_url: str) -> Iterator[LogicalTable]:
    with logical_table(lossy_url) as table:
        yield table


def _config(table: LogicalTable, **more: Any) -> PollerConfig:
    return poller_config(table.url, table.name, signal_table=table.config.signal_table, **more)


def rebuild(events: list[RowChange]) -> dict[int, str]:
    target: dict[int, str] = {}
    for e in events:
        if e.op == "delete":
            target.pop(e.pk["id"], None)
        else:
            assert e.after is not None
            target[e.pk["id"]] = e.after["v"]
    return target


def source_rows(table: LogicalTable) -> dict[int, str]:
    with table.engine.connect() as conn:
        return {r.id: r.v for r in conn.execute(sa.text(f"SELECT id, v FROM {table.name}"))}


def _checkpoint(store: MemoryStateStore) -> Position:
    snap = store.load()
    assert snap is not None and snap.doc.checkpoint.position is not None
    return snap.doc.checkpoint.position


def _stream_then_lose(table: LogicalTable, config: PollerConfig, store: MemoryStateStore, sink: RecordingSink) -> None:
    """Rows 0-19 delivered; then, uncommitted to any checkpoint, rows 0-4 updated, 5 deleted and
    100-104 inserted (the gap); then the slot is lost, and row 6 is updated after the loss."""
    table.insert(range(20), "old")
    drain(config, PgLogicalSource(config), store, sink)
    assert len(events_of(sink.accepted)) == 20
    table.sql("UPDATE {t} SET v = 'gap' WHERE id < 5", "DELETE FROM {t} WHERE id = 5")
    table.insert(range(100, 105), "gap")
    lose_slot(table.engine, table.config.slot or "")
    table.sql("UPDATE {t} SET v = 'after-loss' WHERE id = 6")


def _assert_nothing_lost_but_the_gap_delete(table: LogicalTable, sink: RecordingSink) -> None:
    target, source = rebuild(events_of(sink.accepted)), source_rows(table)
    assert {k: target.get(k) for k in source} == source  # every current row, with its current value
    assert set(target) - set(source) == {5}  # deleted while the slot was lost: not reported (documented)


def test_a_lost_slot_fails_naming_the_slot_what_was_lost_and_the_one_command(logical: LogicalTable) -> None:
    config = _config(logical)
    store, sink = MemoryStateStore("p"), RecordingSink()
    _stream_then_lose(logical, config, store, sink)
    before = _checkpoint(store)
    # When a tick runs on the invalidated slot
    with pytest.raises(PositionLostError) as caught:
        run_tick(config, PgLogicalSource(config), store, sink, owner_id="a")
    # Then the error names the slot, why it is gone, what was lost and the one command
    text = str(caught.value)
    assert f"replication slot '{config.slot}'" in text and "wal_status = lost" in text
    assert "max_slot_wal_keep_size" in text and f"checkpoint {Lsn(int(before.cursor))}" in text  # type: ignore[arg-type]
    assert "changes committed after its confirmed position" in text
    assert f"dbfanout validate --fix {config.name}" in text and 'on_lost_position = "resnapshot"' in text
    # And nothing was sent and the checkpoint did not move
    assert len(events_of(sink.accepted)) == 20 and _checkpoint(store) == before
    # And status says the same
    with pytest.raises(PositionLostError, match="wal_status = lost"):
        _slot_source(PgLogicalSource(config), config, before)


def test_a_slot_lost_after_its_check_is_named_by_the_read_that_fails(logical: LogicalTable) -> None:
    # Given a source that checked its slot (at its first fetch) and read it
    config = _config(logical)
    source = PgLogicalSource(config)
    logical.insert(range(3))
    page = source.fetch(None, 10)
    assert len(page) == 3
    # When the slot is lost before the next read (no new check: the peek itself fails)
    lose_slot(logical.engine, config.slot or "")
    # Then the failed read is reported as the lost position, not as the driver's text
    with pytest.raises(PositionLostError, match="wal_status = lost"):
        source.fetch(page.end, 10)


def test_the_timer_logs_a_lost_slot_once_without_a_traceback(
    logical: LogicalTable, caplog: pytest.LogCaptureFixture
) -> None:
    # Given a lost slot behind the real timer function of a poller
    config = _config(logical)
    store, sink = MemoryStateStore("p"), RecordingSink()
    _stream_then_lose(logical, config, store, sink)
    app = parse_config({"app": {"name": "t"}, "pollers": {"p": {"kind": "pg_logical", "source_url": logical.url,
                        "tables": [logical.name], "slot": config.slot, "publication": config.publication,
                        "signal_table": config.signal_table, "queue": "q"}}}, {})  # fmt: skip
    assert isinstance(app, Config)
    runtimes = Runtimes(app)
    runtimes._runtimes["p"] = PollerRuntime(app, "p", source=PgLogicalSource(app.pollers["p"]), store=store, sink=sink)
    metrics.last_success_timestamp.record(0.0, {"poller": "p"})
    tick = _timer(runtimes, "p")
    # When it fires three times
    with caplog.at_level(logging.DEBUG, logger="dbfanout"):
        for _ in range(3):
            tick(TimerRequest())  # returns: the host would log a traceback for every firing that raised
    # Then one ERROR line names the loss, with no traceback, and no firing counted as a success
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1, [r.getMessage() for r in errors]
    assert "wal_status = lost" in errors[0].getMessage() and errors[0].exc_info is None
    assert metrics.last_success_timestamp.get({"poller": "p"}) == 0.0
    runtimes.close()


def test_validate_fix_replaces_a_lost_slot_and_its_snapshot_delivers_every_row(logical: LogicalTable) -> None:
    config = _config(logical, snapshot_chunk_size=10, batch_size=10)
    store, sink = MemoryStateStore("p"), RecordingSink()
    _stream_then_lose(logical, config, store, sink)
    # Given validate without --fix: the slot check fails and names the command
    (check,) = [c for c in slot_checks(config) if c.name == "slot"]
    assert check.status == "fail" and "wal_status = lost" in check.detail and "validate --fix" in check.detail
    # When validate --fix runs
    fixed = {c.name: c for c in slot_checks(config, fix=True)}
    # Then it replaced the slot and requested the snapshot (it used to refuse: rc 1)
    assert fixed["slot"].status == "ok" and "replaced" in fixed["slot"].detail, fixed["slot"]
    assert fixed["snapshot"].status == "ok" and "requested a snapshot" in fixed["snapshot"].detail
    assert wal_status(logical.engine, config.slot or "") == "reserved"
    assert all(c.status != "fail" for c in slot_checks(config))
    # And the poller's next ticks deliver every current row, the ones changed while it was lost included
    drain(config, PgLogicalSource(config), store, sink)
    _assert_nothing_lost_but_the_gap_delete(logical, sink)
    # And later changes stream as before
    logical.sql("UPDATE {t} SET v = 'later' WHERE id = 1", "DELETE FROM {t} WHERE id = 2")
    drain(config, PgLogicalSource(config), store, sink)
    _assert_nothing_lost_but_the_gap_delete(logical, sink)


def test_resnapshot_recovers_unattended_and_delivers_every_row_and_every_later_change(logical: LogicalTable) -> None:
    config = _config(logical, on_lost_position="resnapshot", snapshot_chunk_size=10, batch_size=10)
    store, sink = MemoryStateStore("p"), RecordingSink()
    _stream_then_lose(logical, config, store, sink)
    source = PgLogicalSource(config)
    # When the next tick finds the slot lost: step 1, the snapshot of every table is checkpointed
    # before the slot is touched, at a position before the whole log (DBZ-5739: nothing skipped)
    result = run_tick(config, source, store, sink, owner_id="a")
    assert result.rows == 0
    position = _checkpoint(store)
    assert position.cursor == 0 and position.snapshot is not None and position.snapshot.active
    assert position.snapshot.id.startswith(LOST_SNAPSHOT_PREFIX)
    assert position.snapshot.tables == (f"public.{logical.name}",)
    assert wal_status(logical.engine, config.slot or "") == "lost"
    # And while the next ticks replace the slot and run the snapshot, the application keeps writing
    writes = iter(["UPDATE {t} SET v = 'during' WHERE id = 7", "INSERT INTO {t} (id, v, n) VALUES (200, 'during', 0)"])

    def write_during(_batch: object) -> None:
        statement = next(writes, None)
        if statement is not None:
            logical.sql(statement)

    sink.before_accept = write_during
    drain(config, source, store, sink)
    drain(config, source, store, sink)  # the writes made during the last tick's pages
    sink.before_accept = None
    # Then the slot is a new, healthy one, the snapshot finished, and nothing is lost
    assert wal_status(logical.engine, config.slot or "") == "reserved"
    state = _checkpoint(store).snapshot
    assert state is not None and not state.active and state.rows >= len(source_rows(logical))
    _assert_nothing_lost_but_the_gap_delete(logical, sink)
    # And every later change streams from the new slot
    logical.sql("UPDATE {t} SET v = 'later' WHERE id = 1", "DELETE FROM {t} WHERE id = 2")
    logical.insert([300], "later")
    drain(config, source, store, sink)
    _assert_nothing_lost_but_the_gap_delete(logical, sink)
    assert [(e.change, e.pk["id"]) for e in events_of(sink.accepted)[-3:]] == [
        ("update", 1), ("delete", 2), ("insert", 300)
    ]  # fmt: skip


def test_resnapshot_resumes_after_a_crash_between_its_steps(logical: LogicalTable) -> None:
    config = _config(logical, on_lost_position="resnapshot", snapshot_chunk_size=10, batch_size=10)
    store, sink = MemoryStateStore("p"), RecordingSink()
    _stream_then_lose(logical, config, store, sink)
    # Given step 1 landed, and the process died right after the next one replaced the slot
    run_tick(config, PgLogicalSource(config), store, sink, owner_id="a")
    with logical.engine.begin() as conn:
        conn.execute(sa.text("SELECT pg_drop_replication_slot(:s)"), {"s": config.slot})
        conn.execute(sa.text("SELECT pg_create_logical_replication_slot(:s, 'pgoutput')"), {"s": config.slot})
    logical.sql("UPDATE {t} SET v = 'after-crash' WHERE id = 8")
    # When a new process takes over (a new source, no memory of either step)
    drain(config, PgLogicalSource(config), store, sink, owner_id="b")
    # Then the snapshot the checkpoint holds runs on the slot it finds, and nothing is lost
    _assert_nothing_lost_but_the_gap_delete(logical, sink)


@pytest.mark.parametrize("mode", ["fail", "resnapshot"])
def test_a_checkpoint_ahead_of_the_servers_log_never_skips_its_changes(logical: LogicalTable, mode: str) -> None:
    # Given a checkpoint whose LSN is past the end of this server's log (a restore, or a failover to
    # a standby that was behind): every change of the slot would be "at or before the checkpoint"
    config = _config(logical, on_lost_position=mode, snapshot_chunk_size=10, batch_size=10)
    store, sink = MemoryStateStore("p"), RecordingSink()
    logical.insert(range(10), "old")
    drain(config, PgLogicalSource(config), store, sink)
    snap = store.load()
    assert snap is not None and snap.doc.checkpoint.position is not None
    ahead = replace(snap.doc.checkpoint.position, cursor=Lsn(int(snap.doc.checkpoint.position.cursor) + (1 << 40)))  # type: ignore[arg-type]
    store.put_raw(encode_state(snap.doc.with_checkpoint(replace(snap.doc.checkpoint, position=ahead))))
    logical.sql("UPDATE {t} SET v = 'new' WHERE id = 3")
    logical.insert([50], "new")
    if mode == "fail":
        # Then the poller stops and says why, instead of skipping the changes silently
        with pytest.raises(PositionLostError, match="is ahead of the end of the log"):
            drain(config, PgLogicalSource(config), store, sink)
        return
    # Then, with resnapshot, it starts over before the log and delivers every row and change
    drain(config, PgLogicalSource(config), store, sink)
    drain(config, PgLogicalSource(config), store, sink)
    target, source = rebuild(events_of(sink.accepted)), source_rows(logical)
    assert target == source


def test_on_lost_position_is_validated_and_only_for_log_sources(logical: LogicalTable) -> None:
    assert _config(logical).on_lost_position == "fail"
    assert _config(logical, on_lost_position="resnapshot").on_lost_position == "resnapshot"
    with pytest.raises(ConfigError, match="on_lost_position: must be one of fail, resnapshot"):
        _config(logical, on_lost_position="skip")
    keyset = {"source_url": "sqlite://", "table": "t", "cursor": "c", "pk": ["id"], "queue": "q"}
    with pytest.raises(ConfigError, match="applies to kind = 'pg_logical' only"):
        parse_config({"app": {"name": "t"}, "pollers": {"k": {**keyset, "on_lost_position": "resnapshot"}}}, {})

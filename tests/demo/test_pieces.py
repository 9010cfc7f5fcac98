"""The demo's parts on their own: the poison handler, the writer, process-group shutdown."""

from __future__ import annotations

import datetime as dt
import json
import os
import sys
import time
from pathlib import Path

import pytest
import sqlalchemy as sa
from rich.console import Console

from dbfanout.demo.appdir import SOURCE_DDL, sqlite_engine
from dbfanout.demo.handler import (
    FIX_SETTING,
    PoisonRowError,
    as_row_change,
    as_versioned_change,
    handle,
    is_fixed,
    is_poison,
)
from dbfanout.demo.mysql_source import MysqlDemoSource
from dbfanout.demo.probe import Snapshot
from dbfanout.demo.services import ChildProcess, wait_for
from dbfanout.demo.view import _panel
from dbfanout.demo.writer import SourceWriter
from dbfanout.ops.status import snapshot_line, snapshot_progress
from poller.sources.mysql_binlog.position import BinlogPosition
from poller.sources.mysql_binlog.source import MysqlBinlogSource
from shared.models import HandlerContext, Lsn, Position, RowChange, SnapshotState
from shared.outbox import create_outbox
from tests.poller.mysql_binlog_support import poller_config


def _event(status: str) -> RowChange:
    return RowChange(event_id="e1", op="upsert", pk={"id": 1}, cursor=1, after={"id": 1, "status": status},
                     poller="orders")  # fmt: skip


CONTEXT = HandlerContext(poller="orders", message_id="m1", delivery_count=1, enqueued_time=None)


def test_the_handler_fails_on_a_poison_row_until_the_fix_file_exists(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given the fix setting points at a file that does not exist yet
    marker = tmp_path / "fixed"
    monkeypatch.setenv(FIX_SETTING, str(marker))
    assert is_poison(_event("poison")) and not is_poison(_event("paid"))
    # When a batch holds a poison row, Then the whole message fails
    with pytest.raises(PoisonRowError, match="poison row"):
        handle([_event("paid"), _event("poison")], CONTEXT)
    # When the fix is deployed (the file appears), Then the check sees it on the next call
    marker.touch()
    assert is_fixed()


def test_without_the_setting_the_handler_is_never_fixed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(FIX_SETTING, raising=False)
    assert not is_fixed()


def test_the_writer_inserts_updates_and_soft_deletes_and_leaves_the_poison_row_alone(tmp_path: Path) -> None:
    # Given a source table and a fast writer
    path = tmp_path / "source.db"
    engine = sqlite_engine(path)
    with engine.begin() as conn:
        conn.exec_driver_sql(SOURCE_DDL)
    writer = SourceWriter(path, rate=800, seed=3).start()
    # When it runs and a poison row is requested
    wait_for(lambda: writer.written >= 100, 20, "100 changes")
    writer.inject_poison()
    wait_for(lambda: writer.poison_id is not None and writer.written >= 400, 20, "the poison row and 400 changes")
    writer.stop()
    # Then every kind of change was written, versions are dense, and the poison row was never touched again
    assert all(n > 0 for n in writer.ops.values()), writer.ops
    with engine.connect() as conn:
        versions = [v for (v,) in conn.execute(sa.text("SELECT version FROM orders"))]
        poison = conn.execute(sa.text("SELECT status, deleted_at FROM orders WHERE id = :i"),
                              {"i": writer.poison_id}).one()  # fmt: skip
    assert max(versions) == writer.version == writer.written
    assert tuple(poison) == ("poison", None)
    assert writer.seconds_behind(writer.version) == 0.0 and writer.seconds_behind(0) > 0
    engine.dispose()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purpose (its parent, the shell, was killed and init reaps it)
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


def test_stopping_a_child_also_stops_its_grandchildren(tmp_path: Path) -> None:
    # Given a child that starts a grandchild and records its pid
    pid_file = tmp_path / "grandchild.pid"
    script = f"import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(60)"  # noqa: E501
    child = ChildProcess([sys.executable, "-c", script], cwd=tmp_path, log=tmp_path / "child.log")
    wait_for(lambda: pid_file.exists() and pid_file.read_text() != "", 20, "the grandchild")
    grandchild = int(pid_file.read_text())
    # When the child is stopped
    started = time.monotonic()
    child.stop(grace=5)
    # Then the whole process group is gone
    assert not child.alive()
    wait_for(lambda: not _alive(grandchild), 10, "the grandchild to exit")
    assert time.monotonic() - started < 10


def test_the_outbox_writer_hard_deletes_and_writes_one_outbox_row_per_change(tmp_path: Path) -> None:
    path = tmp_path / "source.db"
    engine = sqlite_engine(path)
    with engine.begin() as conn:
        conn.exec_driver_sql(SOURCE_DDL)
        create_outbox(conn)
    writer = SourceWriter(path, rate=800, seed=5, outbox=True).start()
    wait_for(lambda: writer.ops["delete"] >= 5, 20, "5 deletes")
    writer.stop()
    with engine.connect() as conn:
        outbox = conn.execute(sa.text("SELECT id, aggregate, type, payload FROM dbfanout_outbox ORDER BY id")).all()
        live = conn.execute(sa.text("SELECT count(*), count(deleted_at) FROM orders")).one()
    engine.dispose()
    # One outbox row per change, in version order; deletes removed the rows (no soft-delete marks)
    assert len(outbox) == writer.written and tuple(live) == (writer.ops["insert"] - writer.ops["delete"], 0)
    assert [json.loads(p)["version"] for *_, p in outbox] == list(range(1, writer.written + 1))
    # The demo handler turns the outbox events back into row changes keyed by id, versioned by version
    event = RowChange("e1", "delete", {"aggregate": "7"}, 99, {"id": 7, "version": 12}, "orders", change="delete")
    again = as_row_change(event)
    assert (again.pk, again.cursor, again.op, again.event_id) == ({"id": 7}, 12, "delete", "e1")


def test_the_pg_logical_handler_orders_a_hard_delete_after_the_rows_last_version() -> None:
    # Given a slot update (version 7) and then the row's hard delete (before: the old row, version 7)
    update = RowChange("ev-1", "upsert", {"id": 1}, (Lsn(100), 0), {"id": 1, "version": 7}, "orders", change="update")
    delete = RowChange("ev-2", "delete", {"id": 1}, (Lsn(200), 0), None, "orders", before={"id": 1, "version": 7})
    # Then the example handler sees version 7 for the update and a later cursor for the delete
    assert as_versioned_change(update).cursor == 7
    assert as_versioned_change(delete).cursor > as_versioned_change(update).cursor  # type: ignore[operator]


def test_the_live_view_shows_a_running_snapshot_as_status_does() -> None:
    # Given a probe reading of a pg_logical poller whose snapshot is half way (as the state blob has it)
    started = dt.datetime(2026, 11, 25, 12, 0, tzinfo=dt.UTC)
    state = SnapshotState(id="r1", tables=("demo.orders",), chunk_size=50, last_key={"id": 149}, rows=150,
                          chunks=3, estimate=400, started_at=started)  # fmt: skip
    progress = snapshot_progress(state, started + dt.timedelta(seconds=3))
    reading = Snapshot(elapsed=12.0, phase="replayed", written={"insert": 1, "update": 0, "delete": 0}, version=1,
                       enqueued=1, lag_changes=0, lag_seconds=0.0, queue_messages=0, handled=1, distinct=1,
                       duplicates=0, dlq=0, snapshot=progress)  # fmt: skip
    # When the view draws it
    console = Console(record=True, width=160)
    console.print(_panel(reading))
    text = console.export_text()
    # Then it shows the table, the chunk, the rows, the rate and the ETA, in status's words
    assert "running: demo.orders, chunk 4, 150 rows of ~400, 50 rows/s, ETA 5s" in text
    assert snapshot_line(progress) == "snapshot running: demo.orders, chunk 4, 150 rows of ~400, 50 rows/s, ETA 5s"
    assert reading.to_json()["snapshot"]["rows"] == 150


def test_the_binlog_writer_maps_every_binlog_checkpoint_back_to_the_versions_it_covers(mysql_binlog_url: str) -> None:
    # Given the demo's orders table on a server with the binlog, and a binlog source started at its end
    demo = MysqlDemoSource(mysql_binlog_url, SOURCE_DDL)
    demo.create()
    source = MysqlBinlogSource(poller_config(demo.url, [demo.table], server_id=demo.server_id))
    try:
        start = source.fetch(None, 10).advance
        assert start is not None
        # When the demo's writer writes a few hundred changes, many per transaction, deletes included
        writer = SourceWriter(demo.engine(), 400, seed=7, hard_deletes=True).start()
        wait_for(lambda: writer.version >= 300 or writer.error is not None, 60, "300 changes")
        writer.stop()
        assert writer.ops["delete"] > 0
        assert writer.version_at_binlog(_binlog_at(start)[0], _binlog_at(start)[1]) == 0
        # And every change is read back from the binlog, page by page
        covered, after = [], start
        for _ in range(1000):
            page = source.fetch(after, 37)  # pages that end inside transactions
            covered += [writer.version_at_binlog(*_binlog_at(row.position)) for row in page.rows]
            after = page.end or after
            if len(covered) >= writer.version:
                break
        # Then the checkpoint after the n-th change maps to version n (one row change per version),
        # inside a transaction as at its end
        assert covered == list(range(1, writer.version + 1))
        assert writer.version_at_binlog(*_binlog_at(after)) == writer.version
    finally:
        source.close()
        demo.drop()


def _binlog_at(position: Position) -> tuple[tuple[int, int], int]:
    at = BinlogPosition.from_position(position)
    return (at.file_number, at.txn_pos), at.seq

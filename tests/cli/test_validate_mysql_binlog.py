"""validate, status, tick and snapshot for a kind = "mysql_binlog" poller: MariaDB with the binlog on, Azurite."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import sqlalchemy as sa

from tests.cli.conftest import Workspace
from tests.poller.mysql_binlog_support import BinlogTables, binlog_tables

pytestmark = pytest.mark.integration


@pytest.fixture
def tables(mysql_binlog_url: str) -> Iterator[BinlogTables]:
    with binlog_tables(mysql_binlog_url) as made:
        yield made


def _add_poller(workspace: Workspace, tables: BinlogTables, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BINLOG_URL", tables.url)
    workspace.config_path.write_text(
        workspace.config_path.read_text()
        + f'\n[pollers.changes]\nkind = "mysql_binlog"\nsource_url = "${{BINLOG_URL}}"\ntables = ["{tables.name}"]\n'
        + f'queue = "{workspace.queue}"\n'
    )


def test_validate_checks_the_binlog_and_a_tick_delivers_a_hard_delete(
    workspace: Workspace, tables: BinlogTables, monkeypatch: pytest.MonkeyPatch
) -> None:
    _add_poller(workspace, tables, monkeypatch)
    # validate checks each binlog setting, the grants and a real stream
    result = workspace.run("validate", "changes", "--json")
    checks = {c["name"]: c["status"] for c in json.loads(result.stdout)["checks"]}
    for name in ("log_bin", "binlog_format", "binlog_row_image", "binlog_row_metadata", "grants", "stream"):
        assert checks[name] == "ok", (name, result.stdout)
    # the first tick takes the binlog's end as its starting point; the next delivers what came after
    workspace.tick("changes")
    tables.insert([1, 2])
    tables.sql("DELETE FROM {t} WHERE id = 1")
    from tests.poller.tick_support import RecordingSink

    sink = RecordingSink()
    workspace.tick("changes", sink=sink)
    events = [e for b in sink.accepted for e in b.events]
    assert [(e.change, e.pk["id"]) for e in events] == [("insert", 1), ("insert", 2), ("delete", 1)]
    # status shows the checkpoint (its binlog position) and the binlog after it (from its transaction's start)
    status = workspace.run("status", "changes", "--json")
    assert status.exit_code == 0, status.stdout + status.stderr
    (row,) = json.loads(status.stdout)
    assert row["checkpoint"]["cursor"]["tiebreaker"]["file"].startswith("binlog")
    assert row["source"]["lag_bytes"] < 1024 and row["source"]["binlog_end"].startswith("binlog")


def test_validate_fix_creates_the_signal_table_then_a_snapshot_is_queued_read_and_shown_by_status(
    workspace: Workspace, tables: BinlogTables, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a binlog poller with a signal table of its own (not created yet), its start taken,
    # and rows that existed before it
    _add_poller(workspace, tables, monkeypatch)
    signal = f"{tables.name}_sig"
    workspace.config_path.write_text(workspace.config_path.read_text() + f'signal_table = "{signal}"\n')
    tables.insert([1, 2, 3])
    try:
        workspace.tick("changes")
        # validate says the signal table is missing; --fix creates it
        checks = {c["name"]: c for c in json.loads(workspace.run("validate", "changes", "--json").stdout)["checks"]}
        assert checks["signal table"]["status"] == "warn" and "validate --fix" in checks["signal table"]["detail"]
        fixed = workspace.run("validate", "changes", "--fix", "--json")
        checks = {c["name"]: c for c in json.loads(fixed.stdout)["checks"]}
        assert checks["signal table"]["status"] == "ok", fixed.stdout
        # When `dbfanout snapshot` queues one (a table of another poller is refused) and the poller ticks
        refused = workspace.run("snapshot", "changes", "--table", "elsewhere")
        assert refused.exit_code == 2 and "not among" in refused.stdout + refused.stderr
        queued = workspace.run("snapshot", "changes", "--json")
        assert queued.exit_code == 0, queued.stdout + queued.stderr
        assert json.loads(queued.stdout)["tables"] == [tables.qualified]
        from tests.poller.tick_support import RecordingSink

        sink = RecordingSink()
        workspace.tick("changes", sink=sink)
        # Then every existing row came as a read, and status shows the snapshot done
        reads = [e for b in sink.accepted for e in b.events if e.change == "read"]
        assert sorted(e.pk["id"] for e in reads) == [1, 2, 3]
        (row,) = json.loads(workspace.run("status", "changes", "--json").stdout)
        snap = row["snapshot"]
        assert (snap["status"], snap["rows"], snap["id"]) == ("done", 3, json.loads(queued.stdout)["request"])
    finally:
        with tables.engine.begin() as conn:
            conn.execute(sa.text(f"DROP TABLE IF EXISTS {signal}"))

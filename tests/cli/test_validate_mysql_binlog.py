"""validate, status, tick and snapshot for a kind = "mysql_binlog" poller: MariaDB with the binlog on, Azurite."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

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


def test_snapshot_of_a_binlog_poller_is_refused_saying_it_is_not_available_yet(
    workspace: Workspace, tables: BinlogTables, monkeypatch: pytest.MonkeyPatch
) -> None:
    _add_poller(workspace, tables, monkeypatch)
    result = workspace.run("snapshot", "changes")
    assert result.exit_code == 2
    text = result.stdout + result.stderr
    assert "not available" in text and "keyset" in text

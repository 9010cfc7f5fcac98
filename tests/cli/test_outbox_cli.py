"""validate, status and checkpoint export of an outbox poller (SQLite, Azurite, the emulator)."""

from __future__ import annotations

import json

import pytest
import sqlalchemy as sa

from shared.outbox import create_outbox, write_change
from tests.cli.conftest import Workspace

pytestmark = pytest.mark.integration

OUTBOX = """
[pollers.changes]
kind = "outbox"
source_url = "${{ORDERS_DB_URL}}"
table = "dbfanout_outbox"
queue = "{queue}"
batch_size = 3
lease_ttl_seconds = 30
settle_seconds = 0
"""


@pytest.fixture
def outbox(workspace: Workspace) -> Workspace:
    workspace.config_path.write_text(workspace.config_path.read_text() + OUTBOX.format(queue=workspace.queue))
    with workspace.source.engine.begin() as conn:
        create_outbox(conn)
        for i in range(5):
            write_change(conn, aggregate=str(i), type="insert", payload={"i": i})
    return workspace


def _checks(result) -> dict[str, dict[str, str]]:
    return {c["name"]: c for c in json.loads(result.stdout)["checks"]}


def test_validate_checks_the_outbox_table_its_index_and_retention(outbox: Workspace) -> None:
    result = outbox.run("validate", "changes", "--json")
    assert result.exit_code == 0, result.stdout + result.stderr
    checks = _checks(result)
    assert checks["source"]["status"] == checks["index"]["status"] == "ok"
    assert "outbox" in checks["source"]["detail"]
    assert checks["outbox retention"]["status"] == "warn"
    # When the settle window's index is missing, validate fails on it
    with outbox.source.engine.begin() as conn:
        conn.execute(sa.text("DROP INDEX ix_dbfanout_outbox_created"))
    checks = _checks(outbox.run("validate", "changes", "--json"))
    assert checks["index"]["status"] == "fail" and "created_at" in checks["index"]["detail"]


def test_validate_names_a_missing_outbox_table_with_its_ddl(workspace: Workspace) -> None:
    workspace.config_path.write_text(workspace.config_path.read_text() + OUTBOX.format(queue=workspace.queue))
    result = workspace.run("validate", "changes", "--json")
    assert result.exit_code == 1
    source = _checks(result)["source"]
    assert source["status"] == "fail" and "CREATE TABLE dbfanout_outbox" in source["detail"]


def test_status_and_checkpoint_export_work_for_an_outbox_poller(outbox: Workspace) -> None:
    outbox.tick("changes")  # one tick: 5 rows in pages of 3, all committed
    with outbox.source.engine.begin() as conn:
        write_change(conn, aggregate="9", type="delete")
    (row,) = json.loads(outbox.run("status", "changes", "--json").stdout)
    assert row["fingerprint_match"] is True and row["source"]["pending_rows"] == 1
    assert row["checkpoint"]["cursor"]["value"] == 5
    exported = outbox.run("checkpoint", "export", "changes")
    assert exported.exit_code == 0, exported.stderr
    assert '"poller_name":"changes"' in exported.stdout.replace(" ", "")


def test_checkpoint_reset_replays_the_outbox_from_a_position(outbox: Workspace) -> None:
    first = outbox.drain("changes")  # all 5 delivered and committed
    result = outbox.run("checkpoint", "reset", "changes", "--to-cursor", "2", "--pk", "id=2", "--yes")
    assert result.exit_code == 0, result.stdout + result.stderr
    # Then the next ticks re-deliver outbox rows 3..5, with the event ids they had the first time
    replayed = [e for b in outbox.drain("changes").accepted for e in b.events]
    assert [e.cursor for e in replayed] == [3, 4, 5]
    assert [e.event_id for e in replayed] == [e.event_id for b in first.accepted for e in b.events][2:]


def test_validate_fix_creates_a_missing_outbox_table_or_index(workspace: Workspace) -> None:
    workspace.config_path.write_text(workspace.config_path.read_text() + OUTBOX.format(queue=workspace.queue))
    result = workspace.run("validate", "changes", "--fix", "--json")
    assert result.exit_code == 0, result.stdout + result.stderr
    checks = _checks(result)
    assert "table dbfanout_outbox" in checks["fix"]["detail"] and checks["source"]["status"] == "ok"
    assert checks["index"]["status"] == "ok"
    # When only the index is missing, --fix creates it; a second run has nothing to do
    with workspace.source.engine.begin() as conn:
        conn.execute(sa.text("DROP INDEX ix_dbfanout_outbox_created"))
    assert (
        "INDEX ix_dbfanout_outbox_created"
        in _checks(workspace.run("validate", "changes", "--fix", "--json"))["fix"]["detail"]
    )
    again = _checks(workspace.run("validate", "changes", "--fix", "--json"))
    assert "fix" not in again and again["index"]["status"] == "ok"

"""`dbfanout validate --fix` and `dbfanout status` on a replication slot PostgreSQL invalidated (issue 32).

The slot is lost for real (``max_slot_wal_keep_size`` on a private server); the CLI runs in-process
against it, Azurite and the emulator. Before issue 32, validate --fix refused to replace it (rc 1).
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from tests.cli.conftest import Workspace
from tests.poller.lost_slot_support import LOSSY_SETTINGS, lose_slot, wal_status
from tests.poller.pg_logical_support import LogicalTable, logical_table
from tests.support.private_postgres import start_private_postgres

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def lossy_url() -> Iterator[str]:
    with start_private_postgres(LOSSY_SETTINGS) as pg:
        yield pg.url


@pytest.fixture
def logical(lossy_url: str) -> Iterator[LogicalTable]:
    with logical_table(lossy_url) as table:
        yield table


def test_validate_fix_replaces_a_lost_slot_and_status_names_the_loss(
    workspace: Workspace, logical: LogicalTable, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LOSSY_URL", logical.url)
    workspace.config_path.write_text(
        workspace.config_path.read_text()
        + f'\n[pollers.changes]\nkind = "pg_logical"\nsource_url = "${{LOSSY_URL}}"\ntables = ["{logical.name}"]\n'
        + f'slot = "{logical.config.slot}"\npublication = "{logical.config.publication}"\n'
        + f'queue = "{workspace.queue}"\nsignal_table = "{logical.config.signal_table}"\n'
    )
    # Given a poller that delivered rows 0-9, then rows changed and its slot lost
    logical.insert(range(10), "old")
    workspace.drain("changes")
    logical.sql("UPDATE {t} SET v = 'gap' WHERE id < 3")
    lose_slot(logical.engine, logical.config.slot or "")
    # Then status names the loss and the command, and validate fails the slot check with it
    (row,) = json.loads(workspace.run("status", "changes", "--json").stdout)
    assert "wal_status = lost" in row["source_error"] and "dbfanout validate --fix changes" in row["source_error"]
    plain = workspace.run("validate", "changes", "--json")
    assert plain.exit_code == 1
    checks = {c["name"]: c for c in json.loads(plain.stdout)["checks"]}
    assert checks["slot"]["status"] == "fail" and "validate --fix" in checks["slot"]["detail"]
    # When validate --fix runs
    fixed = workspace.run("validate", "changes", "--json", "--fix")
    # Then it replaces the slot and requests the snapshot (exit 0), and the next ticks re-deliver the rows
    assert fixed.exit_code == 0, fixed.stdout
    checks = {c["name"]: c for c in json.loads(fixed.stdout)["checks"]}
    assert checks["slot"]["status"] == "ok" and "replaced" in checks["slot"]["detail"]
    assert checks["snapshot"]["status"] == "ok" and "dbfanout status changes" in checks["snapshot"]["detail"]
    assert wal_status(logical.engine, logical.config.slot or "") == "reserved"
    sink = workspace.drain("changes")
    reads = {e.pk["id"]: (e.after or {}).get("v") for b in sink.accepted for e in b.events if e.change == "read"}
    assert reads == {i: ("gap" if i < 3 else "old") for i in range(10)}
    (after,) = json.loads(workspace.run("status", "changes", "--json").stdout)
    assert "source_error" not in after and after["snapshot"]["status"] == "done"

"""validate (--fix) and status for a kind = "pg_logical" poller: real PostgreSQL, Azurite, emulator."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import sqlalchemy as sa

from tests.cli.conftest import Workspace
from tests.poller.pg_logical_support import LogicalTable, logical_table

pytestmark = pytest.mark.integration


@pytest.fixture
def unset_up(pg_logical_url: str) -> Iterator[LogicalTable]:
    """A table with neither publication nor slot (validate --fix creates both; dropped afterwards)."""
    with logical_table(pg_logical_url, slot=False) as table:
        yield table


def _add_poller(workspace: Workspace, table: LogicalTable, monkeypatch: pytest.MonkeyPatch, more: str = "") -> None:
    monkeypatch.setenv("PG_LOGICAL_URL", table.url)
    workspace.config_path.write_text(
        workspace.config_path.read_text()
        + f'\n[pollers.changes]\nkind = "pg_logical"\nsource_url = "${{PG_LOGICAL_URL}}"\ntables = ["{table.name}"]\n'
        + f'slot = "{table.config.slot}"\npublication = "{table.config.publication}"\nqueue = "{workspace.queue}"\n'
        + f'signal_table = "{table.config.signal_table}"\n{more}'
    )


def _checks(stdout: str) -> dict[str, str]:
    return {c["name"]: c["status"] for c in json.loads(stdout)["checks"]}


def test_validate_fix_creates_the_publication_and_the_slot_and_status_shows_the_slot(
    workspace: Workspace, unset_up: LogicalTable, monkeypatch: pytest.MonkeyPatch
) -> None:
    _add_poller(workspace, unset_up, monkeypatch)
    # Given no publication and no slot: validate fails and names the fix, and a tick fails too
    result = workspace.run("validate", "changes", "--json")
    assert result.exit_code == 1
    checks = _checks(result.stdout)
    assert checks["wal_level"] == "ok" and checks["publication"] == "fail" and checks["slot"] == "fail"
    assert "--fix" in result.stdout
    # When validate --fix runs
    fixed = workspace.run("validate", "changes", "--json", "--fix")
    # Then both exist and every check of the source holds
    assert _checks(fixed.stdout)["slot"] == "ok", fixed.stdout
    assert _checks(workspace.run("validate", "changes", "--json").stdout)["slot"] == "ok"
    assert unset_up.confirmed_flush() > 0
    # And status shows the slot: the WAL it retains and its lag behind the log
    unset_up.insert(range(3))
    unset_up.sql("DELETE FROM {t} WHERE id = 0")
    status = workspace.run("status", "changes", "--json")
    assert status.exit_code == 0, status.stdout + status.stderr
    (row,) = json.loads(status.stdout)
    source = row["source"]
    assert source["slot"] == unset_up.config.slot and source["retained_wal_bytes"] >= source["lag_bytes"] > 0
    # And after a tick the slot has caught up with what was delivered
    workspace.tick("changes")
    (after,) = json.loads(workspace.run("status", "changes", "--json").stdout)
    assert after["source"]["lag_bytes"] < source["lag_bytes"]
    assert after["checkpoint"]["cursor"]["kind"] == "pg_lsn"
    assert "MiB of WAL" in workspace.run("status", "changes").stdout


def test_validate_names_a_table_missing_from_the_publication(
    workspace: Workspace, unset_up: LogicalTable, monkeypatch: pytest.MonkeyPatch
) -> None:
    _add_poller(workspace, unset_up, monkeypatch)
    other = f"{unset_up.name}_b"
    with unset_up.engine.begin() as conn:
        conn.execute(sa.text(f"CREATE TABLE {other} (id INTEGER PRIMARY KEY)"))
    try:
        assert workspace.run("validate", "changes", "--fix").exit_code == 0
        workspace.config_path.write_text(
            workspace.config_path.read_text().replace(
                f'tables = ["{unset_up.name}"]', f'tables = ["{unset_up.name}", "{other}"]'
            )
        )
        result = workspace.run("validate", "changes", "--json")
        assert _checks(result.stdout)["publication"] == "fail" and other in result.stdout
        assert _checks(workspace.run("validate", "changes", "--json", "--fix").stdout)["publication"] == "ok"
    finally:
        with unset_up.engine.begin() as conn:
            conn.execute(sa.text(f"DROP TABLE IF EXISTS {other}"))


def test_checkpoint_export_and_reset_to_an_lsn_position(
    workspace: Workspace, unset_up: LogicalTable, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a pg_logical poller that delivered three single-row transactions
    _add_poller(workspace, unset_up, monkeypatch)
    assert workspace.run("validate", "changes", "--fix").exit_code == 0
    for i in (1, 2, 3):
        unset_up.insert([i])
    assert _ids(workspace.drain("changes")) == [1, 2, 3]
    exported = workspace.run("checkpoint", "export", "changes", "--out", "cp.json")
    assert exported.exit_code == 0, exported.stdout + exported.stderr
    cursor = json.loads((workspace.root / "cp.json").read_text())["checkpoint"]["cursor"]
    assert cursor["kind"] == "pg_lsn" and cursor["tiebreaker"] == {"seq": 0}
    # When a change is pending and the operator moves the checkpoint past it, typing an LSN in
    unset_up.insert([4])
    with unset_up.engine.connect() as conn:
        now = conn.execute(sa.text("SELECT CAST(pg_current_wal_lsn() AS text)")).scalar_one()
    reset = workspace.run("checkpoint", "reset", "changes", "--to-cursor", now, "--pk", "seq=0", "--yes")
    assert reset.exit_code == 0, reset.stdout + reset.stderr
    # Then that change is skipped and the next one is delivered
    unset_up.insert([5])
    assert _ids(workspace.drain("changes")) == [5]
    # And restoring the export re-reads nothing: the slot released what it delivered
    assert workspace.run("checkpoint", "reset", "changes", "--from-file", "cp.json", "--yes").exit_code == 0
    assert _ids(workspace.drain("changes")) == []


def _ids(sink: object) -> list[int]:
    return [e.pk["id"] for b in sink.accepted for e in b.events]  # type: ignore[attr-defined]


def test_snapshot_queues_a_snapshot_of_a_live_poller_and_status_shows_its_progress(
    workspace: Workspace, unset_up: LogicalTable, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given rows that predate the slot, and a streaming poller (validate --fix made the signal table)
    unset_up.insert(range(12), "old")
    _add_poller(workspace, unset_up, monkeypatch)
    fixed = workspace.run("validate", "changes", "--json", "--fix")
    assert _checks(fixed.stdout)["signal table"] == "ok", fixed.stdout
    assert workspace.drain("changes").accepted == []  # the slot has nothing: the rows predate it
    # When the operator asks for a snapshot in chunks of 5
    queued = workspace.run("snapshot", "changes", "--chunk-size", "5", "--json")
    assert queued.exit_code == 0, queued.stdout + queued.stderr
    assert json.loads(queued.stdout)["tables"] == [f"public.{unset_up.name}"]
    sink = workspace.drain("changes")  # no change follows the request: its state lands by itself
    # Then every row arrives once as a read
    events = [e for b in sink.accepted for e in b.events]
    assert sorted(e.pk["id"] for e in events if e.change == "read") == list(range(12))
    assert [e for e in events if e.change != "read"] == []
    # And status shows the snapshot, finished, with its counts
    (row,) = json.loads(workspace.run("status", "changes", "--json").stdout)
    snap = row["snapshot"]
    assert (snap["status"], snap["rows"], snap["chunks"], snap["chunk_size"]) == ("done", 12, 3, 5)
    assert "snapshot done: 12 rows" in workspace.run("status", "changes").stdout


def test_checkpoint_reset_from_file_restores_a_running_snapshot(
    workspace: Workspace, unset_up: LogicalTable, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a snapshot in chunks of 5 of 20 rows, one page of 5 a tick; exported after its first page
    unset_up.insert(range(20), "old")
    _add_poller(workspace, unset_up, monkeypatch, "batch_size = 5\nmax_batches_per_tick = 1\n")
    assert workspace.run("validate", "changes", "--fix").exit_code == 0
    assert workspace.run("snapshot", "changes", "--chunk-size", "5").exit_code == 0
    workspace.tick("changes")
    assert workspace.run("checkpoint", "export", "changes", "--out", "cp.json").exit_code == 0
    exported = json.loads((workspace.root / "cp.json").read_text())["checkpoint"]
    assert exported["snapshot"]["rows"] == 5 and exported["snapshot"]["last_key"] == {"id": 4}
    # When it goes on for two pages, then the export is restored
    workspace.tick("changes")
    workspace.tick("changes")
    reset = workspace.run("checkpoint", "reset", "changes", "--from-file", "cp.json", "--yes")
    assert reset.exit_code == 0, reset.stdout + reset.stderr
    # Then the state blob holds the exported snapshot again, cursor and snapshot alike
    (row,) = json.loads(workspace.run("status", "changes", "--json").stdout)
    assert row["checkpoint"]["cursor"] == exported["cursor"]
    assert (row["snapshot"]["status"], row["snapshot"]["rows"]) == ("running", 5)
    # And the snapshot resumes after the exported position: rows 5.. again, none before, then done
    sink = workspace.drain("changes")
    assert [e.pk["id"] for b in sink.accepted for e in b.events] == list(range(5, 20))
    (done,) = json.loads(workspace.run("status", "changes", "--json").stdout)
    assert (done["snapshot"]["status"], done["snapshot"]["rows"]) == ("done", 20)


def test_snapshot_refuses_a_bad_condition_an_unknown_table_and_a_keyset_poller(
    workspace: Workspace, unset_up: LogicalTable, monkeypatch: pytest.MonkeyPatch
) -> None:
    _add_poller(workspace, unset_up, monkeypatch)
    # Before validate --fix: the signal table is missing, and the command says how to fix it
    missing = workspace.run("snapshot", "changes")
    assert missing.exit_code == 1 and "validate --fix" in missing.stdout + missing.stderr
    assert workspace.run("validate", "changes", "--fix").exit_code == 0
    bad = workspace.run("snapshot", "changes", "--where", "no_such_column > 1")
    assert bad.exit_code == 2 and "no_such_column" in bad.stdout + bad.stderr
    assert workspace.run("snapshot", "changes", "--table", "public.elsewhere").exit_code == 2
    assert workspace.run("snapshot", "orders").exit_code == 2  # a keyset poller
    assert workspace.run("snapshot", "changes", "--cancel").exit_code == 0


def test_a_poller_set_up_before_snapshots_validates_with_warnings_and_fix_adds_the_signal_table(
    workspace: Workspace, unset_up: LogicalTable, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a publication and a slot made as before snapshots existed (no signal table)
    _add_poller(workspace, unset_up, monkeypatch)
    cfg = unset_up.config
    with unset_up.engine.begin() as conn:
        conn.execute(sa.text(f"CREATE PUBLICATION {cfg.publication} FOR TABLE {unset_up.name}"))
    with unset_up.engine.begin() as conn:
        conn.execute(sa.text(f"SELECT pg_create_logical_replication_slot('{cfg.slot}', 'pgoutput')"))
    # When validate runs: it still passes (it streams as before), and warns what snapshots need
    result = workspace.run("validate", "changes", "--json")
    assert result.exit_code == 0, result.stdout
    checks = _checks(result.stdout)
    assert checks["signal table"] == "warn" and checks["publication"] == "warn"
    # Then --fix creates the signal table and publishes it
    fixed = _checks(workspace.run("validate", "changes", "--json", "--fix").stdout)
    assert fixed["signal table"] == "ok" and fixed["publication"] == "ok"
    assert _checks(workspace.run("validate", "changes", "--json").stdout)["publication"] == "ok"


def test_snapshot_refuses_a_hostile_condition_and_status_shows_one_the_poller_refused(
    workspace: Workspace, unset_up: LogicalTable, monkeypatch: pytest.MonkeyPatch
) -> None:
    _add_poller(workspace, unset_up, monkeypatch)
    assert workspace.run("validate", "changes", "--fix").exit_code == 0
    unset_up.sql("CREATE SEQUENCE {t}_canary")
    hostile = [
        f"id = (SELECT nextval('{unset_up.name}_canary'))",
        f"nextval('{unset_up.name}_canary') > 0",
        f"1=1; DROP TABLE {unset_up.name}",
        "id > 0 -- everything",
        "id::text = '1'",
    ]
    # When the CLI is given hostile conditions: each is refused with the reason, and none is queued
    for where in hostile:
        refused = workspace.run("snapshot", "changes", "--where", where)
        assert refused.exit_code == 2, (where, refused.stdout)
        assert "--where refused" in refused.stdout + refused.stderr
    with unset_up.engine.connect() as conn:
        assert conn.execute(sa.text(f"SELECT is_called FROM {unset_up.name}_canary")).scalar() is False
        assert conn.execute(sa.text(f"SELECT count(*) FROM {unset_up.config.signal_table}")).scalar() == 0
    # And one written to the signal table by other means is refused by the poller, shown by status
    with unset_up.engine.begin() as conn:
        conn.execute(
            sa.text(f"INSERT INTO {unset_up.config.signal_table} (poller, kind, id, data) VALUES ('changes', "
                    "'request', 'by-hand', :data)"),
            {"data": json.dumps({"action": "snapshot", "where": hostile[0]})},
        )  # fmt: skip
    workspace.drain("changes")
    (row,) = json.loads(workspace.run("status", "changes", "--json").stdout)
    assert row["snapshot"]["status"] == "failed" and "where refused" in row["snapshot"]["error"]
    assert "where refused" in workspace.run("status", "changes").stdout


def test_validate_warns_of_writable_signal_grants_unordered_workers_and_an_initial_snapshot_added_too_late(
    workspace: Workspace, unset_up: LogicalTable, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a streaming poller with a checkpoint, whose signal table PUBLIC may write
    _add_poller(workspace, unset_up, monkeypatch)
    assert workspace.run("validate", "changes", "--fix").exit_code == 0
    unset_up.insert(range(3))
    workspace.drain("changes")
    signal = unset_up.config.signal_table
    unset_up.sql(f"GRANT INSERT ON {signal} TO PUBLIC")
    checks = _checks(workspace.run("validate", "changes", "--json").stdout)
    assert checks["signal grants"] == "warn" and "initial snapshot" not in checks
    assert "snapshot order" not in checks  # snapshot = "never": no reads unless asked
    # When the grant is revoked and snapshot = "initial" is added to the poller (no sessions)
    unset_up.sql(f"REVOKE INSERT ON {signal} FROM PUBLIC")
    workspace.config_path.write_text(workspace.config_path.read_text() + 'snapshot = "initial"\n')
    result = workspace.run("validate", "changes", "--json")
    # Then the grants pass; the missing sessions and the initial snapshot that will not run are named
    checks = _checks(result.stdout)
    assert checks["signal grants"] == "ok"
    assert checks["snapshot order"] == "warn" and "LatestVersions" in result.stdout
    assert checks["initial snapshot"] == "warn" and "dbfanout snapshot changes" in result.stdout
    # And status says what to run
    (row,) = json.loads(workspace.run("status", "changes", "--json").stdout)
    assert "dbfanout snapshot changes" in row["snapshot_hint"]


def test_status_shows_the_last_truncate_of_a_polled_table__issue_42(
    workspace: Workspace, unset_up: LogicalTable, monkeypatch: pytest.MonkeyPatch
) -> None:
    _add_poller(workspace, unset_up, monkeypatch)
    assert workspace.run("validate", "changes", "--fix").exit_code == 0
    # Given a delivered row, then a TRUNCATE of the table, read by the next tick
    unset_up.insert([1])
    workspace.tick("changes")
    unset_up.sql("TRUNCATE {t}")
    workspace.tick("changes")
    # When status runs
    status = workspace.run("status", "changes", "--json")
    # Then it names the truncated table, its position and how many were seen, and retained WAL
    (row,) = json.loads(status.stdout)
    assert row["last_truncate"]["tables"] == [f"public.{unset_up.name}"] and row["last_truncate"]["count"] == 1
    assert row["source"]["retained_wal_bytes"] >= 0
    assert "last TRUNCATE of" in workspace.run("status", "changes").stdout

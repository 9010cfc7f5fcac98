"""``dbfanout demo`` end to end, in its short mode, as a newcomer runs it.

Azurite, the Service Bus emulator, the real function_app.py under ``dbfanout run``, a writer, a
poison row that fills the DLQ, the fix, ``dbfanout dlq replay``, the drain and the check.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import sqlalchemy as sa

from dbfanout.commands.common import EXIT_USAGE
from dbfanout.demo.compare import read_target
from dbfanout.demo.services import azurite_binary
from tests.support.private_mariadb import binlog_reason

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(azurite_binary() is None, reason="Azurite is not installed: run `make bootstrap`"),
]

REPO = Path(__file__).resolve().parents[2]


def _processes_in(folder: str) -> list[str]:
    """Processes still working in the demo's folder (cwd or command line): there must be none."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cwd = os.readlink(entry / "cwd")
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue  # gone, or not ours to inspect
        if cwd.startswith(folder) or folder in cmd:
            found.append(f"{entry.name}: {cmd.strip()}")
    return found


def test_demo_short_mode_replicates_exactly_and_replays_the_poison_row() -> None:
    # Given a fresh environment (the demo picks its own free ports and temp folder)
    env = {k: v for k, v in os.environ.items() if not k.startswith("DBFANOUT_")}
    # When the demo runs in its short mode
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "dbfanout.cli", "demo", "--duration", "20", "--json", "--keep"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    elapsed = time.monotonic() - started
    assert proc.stdout.strip(), proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    folder = summary["app_dir"]
    try:
        # Then it exits 0 with an exact source/target match
        assert proc.returncode == 0, (summary, proc.stderr[-3000:])
        assert summary["ok"] is True and summary["problems"] == []
        check = summary["check"]
        assert check["exact_match"] is True
        assert all(m["count"] == 0 for m in check["mismatches"].values())
        assert check["target_rows"] == check["live_rows"] > 0 and check["deleted_rows"] > 0
        # And every kind of change flowed, all of it enqueued and handled
        written = summary["written"]
        assert written["insert"] > 0 and written["update"] > 0 and written["delete"] > 0
        pipeline = summary["pipeline"]
        assert pipeline["enqueued_changes"] == written["total"]
        assert pipeline["distinct_events"] > 0 and pipeline["queue_messages"] == 0
        assert pipeline["handled_events"] - pipeline["distinct_events"] == pipeline["duplicates_absorbed"]
        # And the poison row went to the DLQ, was replayed with the CLI after the fix, and the DLQ is empty
        dlq = summary["dlq"]
        assert dlq["poison_id"] is not None
        assert dlq["dead_lettered"] >= 1 and dlq["replayed"] >= 1 and dlq["left"] == 0
        assert dlq["replay_exit_code"] == 0
        # And nothing the demo started is still running
        assert _processes_in(folder) == []
        print(f"demo --duration 20 took {elapsed:.1f}s; drain {summary['drain_seconds']}s")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_demo_with_the_outbox_source_replicates_hard_deletes_exactly() -> None:
    # Given the outbox variant: hard deletes, every change written to an outbox table
    env = {k: v for k, v in os.environ.items() if not k.startswith("DBFANOUT_")}
    proc = subprocess.run(
        [sys.executable, "-m", "dbfanout.cli", "demo", "--duration", "15", "--json", "--source", "outbox"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert proc.stdout.strip(), proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    # Then every change arrived: the rows hard-deleted from the source are gone from the target too
    assert proc.returncode == 0, (summary, proc.stderr[-3000:])
    assert summary["ok"] is True and summary["source"] == "outbox"
    check, written = summary["check"], summary["written"]
    assert check["exact_match"] is True and check["deleted_rows"] == 0  # hard deletes leave nothing behind
    assert written["delete"] > 0 and check["source_rows"] == written["insert"] - written["delete"]
    assert check["target_rows"] == check["source_rows"]
    assert summary["pipeline"]["enqueued_changes"] == written["total"]
    assert summary["dlq"]["replayed"] >= 1 and summary["dlq"]["left"] == 0


def test_demo_with_the_pg_logical_source_replicates_hard_deletes_exactly_and_a_snapshot_beside_them(
    pg_logical_url: str,
) -> None:
    # Given the replication-slot variant on a PostgreSQL with wal_level = logical
    env = {k: v for k, v in os.environ.items() if not k.startswith("DBFANOUT_")}
    args = ["demo", "--duration", "15", "--json", "--source", "pg-logical", "--pg-url", pg_logical_url]
    proc = subprocess.run(
        [sys.executable, "-m", "dbfanout.cli", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=240
    )
    assert proc.stdout.strip(), proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    # Then every change arrived through the slot, hard deletes included, and the demo cleaned up
    assert proc.returncode == 0, (summary, proc.stderr[-3000:])
    assert summary["ok"] is True and summary["source"] == "pg-logical"
    check, written = summary["check"], summary["written"]
    assert check["exact_match"] is True and written["delete"] > 0
    assert check["target_rows"] == check["source_rows"] == written["insert"] - written["delete"]
    assert summary["pipeline"]["enqueued_changes"] == written["total"]
    # And the operator's snapshot of the live table (chunks of 50) ran beside the stream: the view
    # followed it from the state blob (as dbfanout status does) until done
    snapshot = summary["snapshot"]
    assert snapshot["status"] == "done" and snapshot["rows"] > 0 and snapshot["chunks"] >= 2, snapshot
    assert "operator runs: dbfanout snapshot orders" in proc.stderr and "snapshot done:" in proc.stderr
    engine = sa.create_engine(pg_logical_url)
    with engine.connect() as conn:
        left = conn.execute(sa.text("SELECT count(*) FROM pg_namespace WHERE nspname LIKE 'dbfanout_demo_%'")).scalar()
    engine.dispose()
    assert left == 0  # the schema, and with it the slot and the publication, were dropped


def test_demo_with_a_topic_quarantines_one_subscription_and_the_other_sees_no_duplicate() -> None:
    # Given the topic variant: one topic, subscriptions replica (poisoned, replayed) and audit
    env = {k: v for k, v in os.environ.items() if not k.startswith("DBFANOUT_")}
    proc = subprocess.run(
        [sys.executable, "-m", "dbfanout.cli", "demo", "--duration", "20", "--json", "--topic"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert proc.stdout.strip(), proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    # Then the replica subscription replicated exactly, after its poison row went through its own DLQ
    assert proc.returncode == 0, (summary, proc.stderr[-3000:])
    assert summary["ok"] is True and summary["topology"] == "topic" and summary["problems"] == []
    assert summary["check"]["exact_match"] is True
    dlq = summary["dlq"]
    assert dlq["dead_lettered"] >= 1 and dlq["replayed"] >= 1 and dlq["left"] == 0
    # And the audit subscription was given every event exactly once: the replica's failed deliveries,
    # its split singles and its replay were addressed to the replica subscription only
    pipeline = summary["pipeline"]
    assert pipeline["audit"]["events"] == pipeline["distinct_events"] > 0
    assert pipeline["audit"]["given_more_than_once"] == 0
    assert pipeline["enqueued_changes"] == summary["written"]["total"]


def _demo_databases(url: str) -> set[str]:
    engine = sa.create_engine(url)
    with engine.connect() as conn:
        names = {str(n) for (n,) in conn.execute(sa.text("SHOW DATABASES LIKE 'dbfanout\\_demo\\_%'"))}
    engine.dispose()
    return names


def test_demo_with_the_mysql_binlog_source_delivers_hard_deletes_as_deletes_exactly(mysql_binlog_url: str) -> None:
    # Given the binlog variant on a MariaDB with the row-based binlog on (a private one when the
    # shared server has it off)
    env = {k: v for k, v in os.environ.items() if not k.startswith("DBFANOUT_")}
    args = ["demo", "--duration", "15", "--json", "--keep", "--source", "mysql-binlog", "--mysql-url", mysql_binlog_url]
    proc = subprocess.run(
        [sys.executable, "-m", "dbfanout.cli", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=240
    )
    assert proc.stdout.strip(), proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    folder = summary["app_dir"]
    try:
        # Then every change arrived from the binlog and the target matches the source exactly
        assert proc.returncode == 0, (summary, proc.stderr[-3000:])
        assert summary["ok"] is True and summary["source"] == "mysql-binlog" and summary["problems"] == []
        check, written = summary["check"], summary["written"]
        assert check["exact_match"] is True and check["deleted_rows"] == 0  # hard deletes leave nothing behind
        assert written["delete"] > 0 and written["update"] > 0
        assert check["target_rows"] == check["source_rows"] == written["insert"] - written["delete"]
        assert summary["pipeline"]["enqueued_changes"] == written["total"]
        assert summary["dlq"]["replayed"] >= 1 and summary["dlq"]["left"] == 0
        # And each hard delete reached the handler as a delete: the target's version table marks
        # exactly the deleted keys as deleted (a delete lost or delivered as an update would not)
        assert check["deletes_applied"] == written["delete"]
        target = sa.create_engine(f"sqlite:///{Path(folder) / 'app' / 'target.db'}")
        deleted = sum(1 for _, gone in read_target(target).versions.values() if gone)
        target.dispose()
        assert deleted == written["delete"]
        # And no snapshot was offered: the kind has none yet
        assert summary["snapshot"] is None and "dbfanout snapshot" not in proc.stderr
        assert _processes_in(folder) == []
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    assert _demo_databases(mysql_binlog_url) == set()  # the demo's database was dropped


def test_demo_with_the_mysql_binlog_source_refuses_a_server_without_a_binlog_at_once(mysql_url: str) -> None:
    # Given the shared MariaDB, which runs with the binlog off
    if binlog_reason(mysql_url) is None:
        pytest.skip("the shared MariaDB has the row-based binlog on: nothing to refuse")
    before = _demo_databases(mysql_url)
    env = {k: v for k, v in os.environ.items() if not k.startswith("DBFANOUT_")}
    # When the binlog demo is pointed at it
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "dbfanout.cli", "demo", "--json", "--source", "mysql-binlog", "--mysql-url", mysql_url],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    elapsed = time.monotonic() - started
    # Then it fails at once, before starting anything, saying what to set and where to point it
    message = " ".join(proc.stderr.split())
    assert proc.returncode == EXIT_USAGE, proc.stderr[-3000:]
    assert proc.stdout == ""
    assert "log_bin" in message and "binlog_format = ROW" in message and "binlog_row_image = FULL" in message
    assert "--mysql-url" in message and "DBFANOUT_DEMO_MYSQL_URL" in message
    assert "Traceback" not in proc.stderr
    assert elapsed < 30, elapsed  # no emulator, Azurite or host was started (those take longer)
    assert _demo_databases(mysql_url) == before  # nothing was created on the refused server

"""validate, status, tick and snapshot for a kind = "mysql_binlog" poller: MariaDB with the binlog on, Azurite.

``validate --fix`` creates the snapshot signal table; ``dbfanout snapshot`` writes MySQL's request row,
which the poller's snapshot coordinator reads from the binlog.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Iterator

import pytest
import sqlalchemy as sa

from poller.snapshot.mysql import signal_table
from poller.snapshot.requests import apply_request, signal_of
from shared.config import PollerConfig
from tests.cli.conftest import Workspace
from tests.poller.mysql_binlog_support import BinlogTables, binlog_changes, binlog_here, binlog_tables
from tests.support.databases import unique_name

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


@pytest.fixture
def own_database(tables: BinlogTables) -> Iterator[str]:
    """A database of its own for the poller's URL: its signal table (``<database>.dbfanout_signal``,
    the default) is this test's alone, created by nothing but the test."""
    name = unique_name("sigdb")
    with tables.engine.begin() as conn:
        conn.execute(sa.text(f"CREATE DATABASE {name}"))
    try:
        yield name
    finally:
        with tables.engine.begin() as conn:
            conn.execute(sa.text(f"DROP DATABASE {name}"))


def _add_poller_in(
    workspace: Workspace, tables: BinlogTables, database: str, monkeypatch: pytest.MonkeyPatch
) -> PollerConfig:
    """A poller whose URL names ``database`` and whose table is named with its own database."""
    url = sa.make_url(tables.url).set(database=database).render_as_string(hide_password=False)
    monkeypatch.setenv("BINLOG_URL", url)
    workspace.config_path.write_text(
        workspace.config_path.read_text()
        + '\n[pollers.changes]\nkind = "mysql_binlog"\nsource_url = "${BINLOG_URL}"\n'
        + f'tables = ["{tables.qualified}"]\nqueue = "{workspace.queue}"\n'
    )
    return workspace.config.poller("changes")


def _signal_check(workspace: Workspace, *args: str) -> list[dict[str, str]]:
    result = workspace.run("validate", "changes", "--json", *args)
    return [c for c in json.loads(result.stdout)["checks"] if c["name"] == "signal table"]


def test_validate_fix_creates_the_signal_table_in_the_source_database(
    workspace: Workspace, tables: BinlogTables, own_database: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _add_poller_in(workspace, tables, own_database, monkeypatch)
    # A missing signal table is a warning naming the fix
    (missing,) = _signal_check(workspace)
    assert missing["status"] == "warn" and "dbfanout validate --fix" in missing["detail"]
    # --fix creates it, an InnoDB table in the URL's database; then it exists
    (created,) = _signal_check(workspace, "--fix")
    assert created["status"] == "ok" and created["detail"].startswith("created: CREATE TABLE")
    with tables.engine.connect() as conn:
        engine = conn.execute(
            sa.text("SELECT ENGINE FROM information_schema.TABLES WHERE TABLE_SCHEMA = :s AND TABLE_NAME = :t"),
            {"s": own_database, "t": "dbfanout_signal"},
        ).scalar()
    assert engine == "InnoDB"
    (exists,) = _signal_check(workspace)
    assert exists == {**exists, "status": "ok", "detail": f"{own_database}.dbfanout_signal exists"}


def test_snapshot_writes_a_request_the_binlog_carries_to_signal_of(
    workspace: Workspace, tables: BinlogTables, own_database: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = _add_poller_in(workspace, tables, own_database, monkeypatch)
    # Without the signal table the request is refused, naming the fix
    refused = workspace.run("snapshot", "changes")
    assert refused.exit_code != 0 and "validate --fix" in refused.stdout + refused.stderr
    assert workspace.run("validate", "changes", "--fix").exit_code in (0, 1)
    # A condition outside the grammar or over unknown columns is refused before anything is written
    bad = workspace.run("snapshot", "changes", "--where", "nope = 1")
    assert bad.exit_code == 2 and "--where refused" in bad.stdout + bad.stderr
    # When a snapshot of one table is requested (named without its database: the poller's is found)
    start = binlog_here(cfg)
    result = workspace.run(
        "snapshot", "changes", "--table", tables.name, "--where", "N >= 1 AND v <> 'x'", "--chunk-size", "9", "--json"
    )
    assert result.exit_code == 0, result.stdout + result.stderr
    out = json.loads(result.stdout)
    assert out["tables"] == [tables.qualified]
    # Then the binlog carries the request row, and signal_of / apply_request read it as the poller will
    changes = binlog_changes(cfg, start, {signal_table(cfg)})
    signals = [signal_of(c.after, "changes") for c in changes]
    assert signals == [
        ("request", out["request"],
         {"action": "snapshot", "tables": [tables.qualified], "where": "N >= 1 AND v <> 'x'", "chunk_size": 9}),
    ]  # fmt: skip
    assert signals[0] is not None
    state, warning = apply_request(cfg, None, signals[0][2], signals[0][1], dt.datetime.now(dt.UTC))
    assert warning is None and state is not None and state.tables == (tables.qualified,) and state.chunk_size == 9


def _poller_on(workspace: Workspace, url: str, table: str, monkeypatch: pytest.MonkeyPatch, more: str = "") -> None:
    monkeypatch.setenv("FRESH_BINLOG_URL", url)
    workspace.config_path.write_text(
        workspace.config_path.read_text()
        + f'\n[pollers.changes]\nkind = "mysql_binlog"\nsource_url = "${{FRESH_BINLOG_URL}}"\ntables = ["{table}"]\n'
        + f'queue = "{workspace.queue}"\n{more}'
    )


def _checks(workspace: Workspace, *args: str) -> list[dict[str, str]]:
    result = workspace.run("validate", "changes", "--json", *args)
    return [c for c in json.loads(result.stdout)["checks"] if c["poller"] == "changes"]


def test_validate_passes_on_a_fresh_server_right_after_fix_for_an_initial_snapshot_of_a_table_with_rows(
    workspace: Workspace, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a freshly set-up MariaDB (binlog on, nothing written since but the table), a table
    # with rows, and a binlog poller with snapshot = "initial" (issue 39: AssertionError, no words)
    from tests.support.private_mariadb import binaries_missing, start_private_mariadb

    if binaries_missing():
        pytest.skip(str(binaries_missing()))
    server = start_private_mariadb()
    try:
        engine = sa.create_engine(server.url)
        with engine.begin() as conn:
            conn.execute(sa.text("CREATE TABLE orders (id INT PRIMARY KEY, v VARCHAR(10))"))
            conn.execute(sa.text("INSERT INTO orders VALUES (1, 'a'), (2, 'b')"))
        engine.dispose()
        _poller_on(workspace, server.url, "orders", monkeypatch, 'snapshot = "initial"\n')
        # When validate --fix creates the signal table, then validate runs again
        fixed = _checks(workspace, "--fix")
        checks = _checks(workspace)
    finally:
        server.stop()
    # Then no check of the poller fails, and each binlog check passes, the stream check included
    assert [c for c in fixed + checks if c["status"] == "fail"] == [], (fixed, checks)
    binlog = ("log_bin", "binlog_format", "binlog_row_image", "binlog_row_metadata", "log_bin_compress",
              "server_id", "grants", "table", "signal table", "stream")  # fmt: skip
    assert {c["name"]: c["status"] for c in checks if c["name"] in binlog} == dict.fromkeys(binlog, "ok")


def test_validate_fails_naming_log_bin_compress_and_a_check_that_raises_says_why(
    workspace: Workspace, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a MariaDB writing compressed binlog events, and a poller whose table does not exist
    # (its stream still opens) and whose URL carries a password the server refuses
    from tests.support.private_mariadb import binaries_missing, start_private_mariadb

    if binaries_missing():
        pytest.skip(str(binaries_missing()))
    server = start_private_mariadb(extra=("--log-bin-compress=ON",))
    try:
        _poller_on(workspace, server.url, "orders", monkeypatch)
        checks = {c["name"]: c for c in _checks(workspace)}
        wrong = sa.make_url(server.url).set(password="s3cret-pw").render_as_string(hide_password=False)
        monkeypatch.setenv("FRESH_BINLOG_URL", wrong)
        refused = _checks(workspace)
    finally:
        server.stop()
    # Then validate fails on the setting, naming it and the fix
    compress = checks["log_bin_compress"]
    assert compress["status"] == "fail" and "log_bin_compress = OFF" in compress["detail"], compress
    # and a check that raises is a failed check with the error's text (never the password) and what to do
    (failed,) = [c for c in refused if c["name"] == "mysql_binlog"]
    assert failed["status"] == "fail" and "OperationalError" in failed["detail"], failed
    assert "s3cret-pw" not in failed["detail"] and "check source_url" in failed["detail"]


def test_status_shows_a_truncate_the_poller_read_from_the_binlog(
    workspace: Workspace, tables: BinlogTables, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given a binlog poller that took its start
    _add_poller(workspace, tables, monkeypatch)
    workspace.tick("changes")
    # When its table is truncated (no rows in the binlog: nothing to deliver) and it ticks
    tables.insert([1])
    tables.sql("TRUNCATE TABLE {t}")
    workspace.tick("changes")
    # Then status shows the truncate, in JSON and in its table
    (row,) = json.loads(workspace.run("status", "changes", "--json").stdout)
    assert [t["table"] for t in row["truncates"]] == [tables.qualified], row
    text = workspace.run("status", "changes")
    assert f"TRUNCATE of {tables.qualified}" in text.stdout, text.stdout

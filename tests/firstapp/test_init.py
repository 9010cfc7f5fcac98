"""``dbfanout init``: what it reads from a table and what it writes (issue 40)."""

from __future__ import annotations

import json
import tomllib
import uuid
from pathlib import Path

import pytest
import sqlalchemy as sa
from typer.testing import CliRunner

from dbfanout.cli import app
from dbfanout.commands.init_files import PLACEHOLDER, PollerPlan, poller_toml
from dbfanout.commands.init_table import inspect_table
from shared.config import parse_config
from tests.host.app_support import drop_pg_schema, pg_schema_url


def init(root: Path, *args: str) -> str:
    result = CliRunner().invoke(app, ["init", "--app-root", str(root), "--yes", "--no-validate", *args])
    assert result.exit_code == 0, result.output
    return result.output


def test_without_a_database_every_unknown_is_a_marked_placeholder(tmp_path: Path) -> None:
    # When init runs with no URL and no table
    output = init(tmp_path)
    # Then the config parses, and each value init could not know carries the marker
    text = (tmp_path / "dbfanout.toml").read_text()
    assert text.count(PLACEHOLDER) == 3  # the table, the cursor, the key
    settings = json.loads((tmp_path / "local.settings.json").read_text())["Values"]
    parse_config(tomllib.loads(text), settings)
    assert settings[f"{_poller(text).upper()}_DB_URL"].startswith(PLACEHOLDER)
    assert PLACEHOLDER in output and "next: replace" in output
    assert (tmp_path / "function_app.py").exists() and (tmp_path / "host.json").exists()


def _poller(text: str) -> str:
    return str(next(iter(tomllib.loads(text)["pollers"])))


def test_a_second_table_is_appended_and_a_taken_name_refused(tmp_path: Path) -> None:
    db = tmp_path / "shop.db"
    engine = sa.create_engine(f"sqlite:///{db}")
    with engine.begin() as conn:
        for table in ("orders", "customers"):
            conn.exec_driver_sql(f"CREATE TABLE {table} (id INTEGER PRIMARY KEY, version INTEGER NOT NULL)")
    engine.dispose()
    init(tmp_path, "--url", f"sqlite:///{db}", "--table", "orders")
    init(tmp_path, "--url", f"sqlite:///{db}", "--table", "customers")
    pollers = tomllib.loads((tmp_path / "dbfanout.toml").read_text())["pollers"]
    assert {name: p["cursor"] for name, p in pollers.items()} == {"orders": "version", "customers": "version"}
    settings = json.loads((tmp_path / "local.settings.json").read_text())["Values"]
    assert {"ORDERS_DB_URL", "CUSTOMERS_DB_URL"} <= set(settings)
    # And the same table again is refused, naming the fix
    again = CliRunner().invoke(app, ["init", "--app-root", str(tmp_path), "--yes", "--no-validate",
                                     "--url", f"sqlite:///{db}", "--table", "orders"])  # fmt: skip
    assert again.exit_code == 2 and "--poller NAME" in again.output


def test_identifiers_from_input_are_quoted_by_the_dialect(tmp_path: Path) -> None:
    # Given a table whose name needs quoting (a space, a quote, a keyword-like column)
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'odd.db'}")
    with engine.begin() as conn:
        conn.exec_driver_sql(
            'CREATE TABLE "Odd ""Orders""" ("Id" INTEGER PRIMARY KEY, "updated_at" TIMESTAMP NOT NULL)'
        )
    # When init reads it
    shape = inspect_table(engine, 'Odd "Orders"')
    # Then the index it needs is a statement that runs as it is
    assert shape.index_sql == 'CREATE INDEX "ix_Odd ""Orders""_dbfanout" ON "Odd ""Orders""" (updated_at, "Id")'
    with engine.begin() as conn:
        conn.exec_driver_sql(shape.index_sql)
    assert inspect_table(engine, 'Odd "Orders"').index_sql is None
    engine.dispose()


def test_a_missing_table_lists_the_tables_there(tmp_path: Path) -> None:
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'x.db'}")
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE orders (id INTEGER PRIMARY KEY)")
    with pytest.raises(LookupError, match="tables here: orders"):
        inspect_table(engine, "order")
    engine.dispose()


@pytest.mark.integration
def test_postgresql_says_whether_a_log_source_is_possible(pg_url: str) -> None:
    # Given a table on the test server, in a schema of its own
    schema = f"init_{uuid.uuid4().hex[:8]}"
    url = pg_schema_url(pg_url, schema)
    engine = sa.create_engine(url)
    try:
        with engine.begin() as conn:
            level = conn.exec_driver_sql("SHOW wal_level").scalar_one()
            conn.exec_driver_sql("CREATE TABLE probe (id int PRIMARY KEY, modified_at timestamptz NOT NULL)")
        # When init reads it
        shape = inspect_table(engine, "probe")
    finally:
        engine.dispose()
        drop_pg_schema(pg_url, schema)
    # Then the cursor is found (aware: no cursor_timezone), and the log source follows wal_level
    assert (shape.cursor, shape.pk, shape.cursor_naive) == ("modified_at", ("id",), False)
    assert (shape.log_kind == "pg_logical") == (level == "logical"), shape.log_detail
    assert f"wal_level = {level}" in shape.log_detail


@pytest.mark.parametrize("kind", ["pg_logical", "mysql_binlog"])
def test_a_log_source_poller_is_a_valid_config(kind: str) -> None:
    # Given what init writes for a log source (the server allowed it)
    plan = PollerPlan(name="orders", kind=kind, table="orders", url_setting="ORDERS_DB_URL", queue="orders-changes",
                      shape=None)  # fmt: skip
    text = '[app]\nname = "shop"\n\n' + poller_toml(plan)
    # Then it parses as that kind, on the table, without the keyset keys
    poller = parse_config(tomllib.loads(text), {"ORDERS_DB_URL": "x"}).poller("orders")
    assert poller.kind == kind
    assert list(poller.tables) == (["public.orders"] if kind == "pg_logical" else ["orders"])


@pytest.mark.integration
def test_mariadb_says_whether_the_binlog_allows_a_log_source(mysql_url: str) -> None:
    # Given a table on the test server (its own name: the database is shared)
    table = f"init_{uuid.uuid4().hex[:8]}"
    engine = sa.create_engine(mysql_url)
    try:
        with engine.begin() as conn:
            conn.exec_driver_sql(f"CREATE TABLE {table} (id INT PRIMARY KEY, updated_at DATETIME(6) NOT NULL)")
            row = conn.exec_driver_sql("SELECT @@log_bin, @@binlog_format, @@binlog_row_image").one()
        # When init reads it
        shape = inspect_table(engine, table)
    finally:
        with engine.begin() as conn:
            conn.exec_driver_sql(f"DROP TABLE IF EXISTS {table}")
        engine.dispose()
    # Then the cursor is found (naive: the config must name its zone), and the log source follows the binlog
    assert (shape.cursor, shape.pk, shape.cursor_naive) == ("updated_at", ("id",), True)
    row_binlog = str(row[0]) in ("1", "ON") and str(row[1]).upper() == "ROW" and str(row[2]).upper() == "FULL"
    assert (shape.log_kind == "mysql_binlog") == row_binlog, shape.log_detail

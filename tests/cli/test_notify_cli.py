"""wake = "notify": `validate --fix` creates the poller's trigger, `notify drop` removes it (PostgreSQL)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from typer.testing import CliRunner, Result

from dbfanout.cli import app
from dbfanout.ops.notify import missing_notify_triggers
from shared.config import load_config
from tests.support.databases import unique_name

pytestmark = pytest.mark.integration


@pytest.fixture
def notify_config(tmp_path: Path, pg_url: str) -> Iterator[Path]:
    table = unique_name("ntf")
    engine = sa.create_engine(pg_url)
    with engine.begin() as conn:
        conn.exec_driver_sql(f"CREATE TABLE {table} (id bigint PRIMARY KEY, version bigint NOT NULL)")
        conn.exec_driver_sql(f"CREATE INDEX ix_{table} ON {table} (version, id)")
    path = tmp_path / "dbfanout.toml"
    path.write_text(
        f"""
[app]
name = "ntf"

[pollers.orders]
source_url = "{pg_url}"
table = "{table}"
cursor = "version"
pk = ["id"]
queue = "orders"
linger_seconds = 2
wake = "notify"
"""
    )
    try:
        yield path
    finally:
        with engine.begin() as conn:
            conn.exec_driver_sql(f"DROP TABLE {table}")
        engine.dispose()


def _run(config: Path, *args: str) -> Result:
    return CliRunner(env={"COLUMNS": "250"}).invoke(app, [*args, "--config", str(config)])


def test_validate_fix_creates_the_notify_trigger_and_notify_drop_removes_it(notify_config: Path) -> None:
    poller = load_config(notify_config, settings={}).poller("orders")
    # Given a notify poller whose table has no trigger: validate says so
    before = json.loads(_run(notify_config, "validate", "orders", "--json").stdout)
    assert {"poller": "orders", "name": "notify trigger", "status": "fail"}.items() <= _check(before).items()
    # When validate --fix runs, Then the trigger exists and the check holds
    fixed = json.loads(_run(notify_config, "validate", "orders", "--fix", "--json").stdout)
    assert _check(fixed)["status"] == "ok"
    assert missing_notify_triggers(poller) == []
    # When the operator drops it (a dry run first), Then it is gone
    dry = _run(notify_config, "notify", "drop", "orders", "--dry-run")
    assert dry.exit_code == 0 and "nothing was dropped" in dry.stdout
    assert missing_notify_triggers(poller) == []
    dropped = _run(notify_config, "notify", "drop", "orders", "--yes")
    assert dropped.exit_code == 0, dropped.stdout
    assert missing_notify_triggers(poller) == [poller.table]


def _check(report: dict[str, object]) -> dict[str, object]:
    checks = report["checks"]
    assert isinstance(checks, list)
    return next(c for c in checks if c["name"] == "notify trigger")

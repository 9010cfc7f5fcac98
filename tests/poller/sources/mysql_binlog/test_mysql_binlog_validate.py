"""``dbfanout validate`` for kind = "mysql_binlog" (dbfanout/ops/binlog_checks.py), against a MariaDB
with the binlog on: each setting, retention, the replica server id, the grants, the tables, a stream."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
import sqlalchemy as sa

from dbfanout.ops.binlog_checks import binlog_checks
from shared.config import PollerConfig
from tests.poller.mysql_binlog_support import BinlogTables, binlog_tables
from tests.support.databases import unique_name

pytestmark = pytest.mark.integration


@pytest.fixture
def tables(mysql_binlog_url: str) -> Iterator[BinlogTables]:
    with binlog_tables(mysql_binlog_url) as made:
        yield made


def _by_name(cfg: PollerConfig, others: tuple[PollerConfig, ...] = ()) -> dict[str, tuple[str, str]]:
    return {c.name: (c.status, c.detail) for c in binlog_checks(cfg, others=others)}


def test_a_server_set_up_for_the_binlog_passes_each_check(tables: BinlogTables) -> None:
    checks = _by_name(tables.config)
    for name in ("log_bin", "binlog_format", "binlog_row_image", "binlog_row_metadata", "server_id", "grants",
                 "table", "stream"):  # fmt: skip
        assert checks[name][0] == "ok", (name, checks[name])
    # and a retention shorter than a stopped poller may need is a warning saying what to set
    status, detail = checks["binlog retention"]
    if status != "ok":
        assert status == "warn" and "binlog_expire_logs_seconds" in detail


def test_a_server_id_that_is_the_servers_own_or_another_pollers_fails(tables: BinlogTables) -> None:
    with tables.engine.connect() as conn:
        own = int(conn.execute(sa.text("SELECT @@server_id")).scalar_one())
    # Given the source server's own id, then then a second poller with the same id
    assert _by_name(dataclasses.replace(tables.config, server_id=own))["server_id"][0] == "fail"
    twin = dataclasses.replace(tables.config, name="twin")
    status, detail = _by_name(tables.config, (tables.config, twin))["server_id"]
    assert status == "fail" and "twin" in detail and "server_id" in detail


def test_a_user_without_replication_grants_is_told_what_to_grant(tables: BinlogTables) -> None:
    # Given a user that may read the tables but not the binlog
    user = unique_name("u")
    with tables.engine.begin() as conn:
        conn.execute(sa.text(f"CREATE USER '{user}'@'%' IDENTIFIED BY 'pw'"))
        conn.execute(sa.text(f"GRANT SELECT ON {tables.database}.* TO '{user}'@'%'"))
    try:
        url = sa.make_url(tables.url).set(username=user, password="pw")
        cfg = dataclasses.replace(tables.config, source_url=url.render_as_string(hide_password=False))
        checks = _by_name(cfg)
        # Then the grants check names both privileges, and the stream check fails
        status, detail = checks["grants"]
        assert status == "fail" and "REPLICATION SLAVE" in detail and "BINLOG MONITOR" in detail
        assert checks.get("mysql_binlog", ("fail", ""))[0] == "fail"
        assert "pw" not in " ".join(d for _, d in checks.values())  # the password is never shown
    finally:
        with tables.engine.begin() as conn:
            conn.execute(sa.text(f"DROP USER '{user}'@'%'"))


def test_a_missing_table_fails(tables: BinlogTables) -> None:
    cfg = dataclasses.replace(tables.config, tables=(f"{tables.database}.no_such_table",))
    status, detail = _by_name(cfg)["table"]
    assert status == "fail" and "no_such_table" in detail

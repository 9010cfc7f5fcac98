"""``dbfanout validate`` for a ``kind = "mysql_binlog"`` poller: the binlog settings, retention,
the replica server id, the grants, the tables, and a real replication stream.

Every failed check says what to change; nothing is changed for the user (binlog settings are
server parameters: on Azure Database for MySQL Flexible Server they are set in the portal or with
``az mysql flexible-server parameter set``), except that ``--fix`` creates the snapshot signal
table (poller/snapshot/mysql.py), as it does for pg_logical pollers.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterator

import sqlalchemy as sa

from dbfanout.ops.checks import Check, Status
from poller.snapshot.mysql import mysql_signal_sql, quote_mysql, signal_table
from poller.sources.engines import source_engine
from poller.sources.mysql_binlog.source import MysqlBinlogSource, qualified_tables
from shared.config import PollerConfig
from shared.errors import ConfigError
from shared.scrub import describe_error

__all__ = ["MIN_RETENTION_SECONDS", "binlog_checks"]

#: Less binlog retention than this is a warning: a poller stopped for a weekend must find its binlog.
MIN_RETENTION_SECONDS = 3 * 86400

_SETTINGS = (
    "log_bin", "binlog_format", "binlog_row_image", "binlog_row_metadata", "server_id",
    "binlog_expire_logs_seconds", "expire_logs_days", "version", "binlog_order_commits",
    "log_bin_compress", "binlog_transaction_compression", "binlog_row_value_options",
)  # fmt: skip
_AZURE = "Azure Flexible Server: Server parameters in the portal, or az mysql flexible-server parameter set"
_WANTED = {
    "binlog_format": ("ROW", "row images are what the poller reads"),
    "binlog_row_image": ("FULL", "updates and deletes carry the whole row (before images, every column)"),
    "binlog_row_metadata": ("FULL", "each change carries its column names (MariaDB 10.5+, MySQL 8.0.1+)"),
}

#: Compressed binlogs (docs/operations.md): MariaDB's compressed events are decompressed by the
#: reader, MySQL's compressed transactions stop the poller; either way validate fails on them.
_COMPRESSION = {
    "log_bin_compress": (
        "MariaDB writes larger row and query events compressed (dbfanout decompresses them, but a replica-protocol "
        "reader that does not stops or skips them)",
        "SET GLOBAL log_bin_compress = OFF, and in the server's config",
    ),
    "binlog_transaction_compression": (
        "MySQL writes transactions as compressed payloads this poller cannot read: it stops at the first one",
        f"SET GLOBAL binlog_transaction_compression = OFF; {_AZURE}",
    ),
}


def binlog_checks(cfg: PollerConfig, *, others: tuple[PollerConfig, ...] = (), fix: bool = False) -> Iterator[Check]:
    """The checks of one mysql_binlog poller (``others``: the config's other pollers, for server ids;
    ``fix``: create the signal table when it is missing). A check that raises is a failed check
    with the error's scrubbed text and what to do, never a crash of validate or a wordless line."""
    p = cfg.name
    try:
        engine = source_engine(cfg)
        with engine.connect() as conn:
            names = ", ".join(f"'{n}'" for n in _SETTINGS)  # constants, not input
            shown = conn.execute(sa.text(f"SHOW GLOBAL VARIABLES WHERE Variable_name IN ({names})"))
            values = {str(k).lower(): str(v) for k, v in shown}
            conn.rollback()
    except Exception as exc:  # unreachable, refused: nothing else can be checked
        yield _failed(p, "mysql_binlog", exc, _WHAT_TO_DO["mysql_binlog"])
        return
    if values.get("log_bin", "OFF").upper() != "ON":
        yield Check(p, "log_bin", "fail", "the server writes no binary log: turn log_bin on and restart it "
                    "(Azure Flexible Server has it on always)")  # fmt: skip
        return
    yield Check(p, "log_bin", "ok", "ON")
    yield from _setting_checks(p, values)
    yield _retention_check(p, values)
    yield from _commit_order_check(cfg, values)
    yield from _guarded(p, "mysql_binlog", lambda: _server_checks(engine, cfg, values, others, fix))
    yield from _guarded(p, "stream", lambda: _stream_check(cfg))


def _server_checks(
    engine: sa.Engine, cfg: PollerConfig, values: dict[str, str], others: tuple[PollerConfig, ...], fix: bool
) -> Iterator[Check]:
    p = cfg.name
    with engine.connect() as conn:
        yield from _guarded(p, "server_id", lambda: _server_id_checks(conn, cfg, values, others))
        yield from _guarded(p, "grants", lambda: _grant_checks(conn, p))
        yield from _guarded(p, "table", lambda: _table_checks(conn, cfg))
        yield from _guarded(p, "signal table", lambda: _signal_check(conn, cfg, fix))
        conn.rollback()


def _guarded(p: str, name: str, checks: Callable[[], Iterator[Check]]) -> Iterator[Check]:
    """``checks()``'s checks; an exception is a failed check ``name`` with its scrubbed text."""
    try:
        yield from checks()
    except Exception as exc:
        yield _failed(p, name, exc, _WHAT_TO_DO.get(name, "fix what the error names, then run validate again"))


_WHAT_TO_DO = {
    "server_id": "the user needs REPLICATION SLAVE ADMIN or REPLICA MONITOR to list replicas; or check server_id",
    "grants": "grant the poller's user REPLICATION SLAVE and REPLICATION CLIENT (MariaDB: BINLOG MONITOR) ON *.*",
    "table": "check that the poller's tables exist and the user may read information_schema",
    "signal table": "create the signal table with `dbfanout validate --fix`, or give the user CREATE on its database",
    "mysql_binlog": "check source_url, the network path and the user's password",
    "stream": "the user needs REPLICATION SLAVE, and the server's binlog settings above must be right; "
    "see docs/operations.md (mysql_binlog)",
}


def _failed(p: str, name: str, exc: Exception, what: str) -> Check:
    return Check(p, name, "fail", f"{describe_error(exc)} ({what})")


def _setting_checks(p: str, values: dict[str, str]) -> Iterator[Check]:
    for name, (wanted, why) in _WANTED.items():
        value = values.get(name)
        if value is None:
            yield Check(p, name, "fail", f"the server has no {name} (needs MariaDB 10.5+ or MySQL 8.0.1+)")
        elif value.upper() != wanted:
            yield Check(p, name, "fail", f"{name} is {value}: set it to {wanted} ({why}); {_AZURE}")
        else:
            yield Check(p, name, "ok", wanted)
    for name, (detail, fix) in _COMPRESSION.items():
        value = values.get(name)
        if value is not None and value.upper() == "ON":
            yield Check(p, name, "fail", f"{name} is ON: {detail}; set it to OFF ({fix})")
        elif value is not None:
            yield Check(p, name, "ok", value.upper())
    partial = values.get("binlog_row_value_options")
    if partial is not None and "PARTIAL_JSON" in partial.upper():
        yield Check(p, "binlog_row_value_options", "fail", "binlog_row_value_options is PARTIAL_JSON: JSON updates "
                    f"are written as diffs, not rows (the poller stops at one); set it to ''; {_AZURE}")  # fmt: skip


def _retention_check(p: str, values: dict[str, str]) -> Check:
    seconds = int(float(values.get("binlog_expire_logs_seconds", "0") or 0))
    if not seconds:
        seconds = int(float(values.get("expire_logs_days", "0") or 0) * 86400)
    fix = f"set binlog_expire_logs_seconds to at least {MIN_RETENTION_SECONDS} (longer than the poller may be stopped)"
    if seconds == 0:
        return Check(p, "binlog retention", "warn",
                     "binlog_expire_logs_seconds is 0: self-managed servers keep binlogs until purged by hand, but "
                     "Azure Flexible Server may delete a binlog as soon as no replica holds it, before a stopped "
                     f"poller reads it; {fix}")  # fmt: skip
    if seconds < MIN_RETENTION_SECONDS:
        return Check(p, "binlog retention", "warn", f"binlogs are kept {seconds} s: a poller stopped longer "
                     f"loses its place (an error, not a skip); {fix}")  # fmt: skip
    return Check(p, "binlog retention", "ok", f"binlogs kept {seconds} s")


def _commit_order_check(cfg: PollerConfig, values: dict[str, str]) -> Iterator[Check]:
    """A snapshot's barrier (poller/snapshot/mysql.py) needs InnoDB to commit in binlog order: MySQL's
    ``binlog_order_commits`` (ON by default); MariaDB has no such setting (it always does)."""
    value = values.get("binlog_order_commits")
    if value is None:
        return
    if value.upper() == "ON":
        yield Check(cfg.name, "binlog_order_commits", "ok", "ON (commits are visible in binlog order)")
        return
    status: Status = "fail" if cfg.snapshot == "initial" else "warn"
    yield Check(cfg.name, "binlog_order_commits", status,
                f"binlog_order_commits is {value}: a snapshot could deliver a row older than a change already "
                f"delivered; set it to ON (the default) before snapshotting; {_AZURE}")  # fmt: skip


def _server_id_checks(
    conn: sa.Connection, cfg: PollerConfig, values: dict[str, str], others: tuple[PollerConfig, ...]
) -> Iterator[Check]:
    p, mine = cfg.name, cfg.server_id
    fix = f"set pollers.{p}.server_id to a number no other server or replica of this source uses"
    if str(mine) == values.get("server_id"):
        yield Check(p, "server_id", "fail", f"server_id {mine} is the source server's own: {fix}")
        return
    same = [o.name for o in others if o.kind == "mysql_binlog" and o.name != p and o.server_id == mine]
    if same:
        yield Check(p, "server_id", "fail", f"server_id {mine} is also poller {', '.join(same)}'s "
                    f"(the server drops one of two replica connections with one id): {fix}")  # fmt: skip
        return
    try:
        replicas = [int(r[0]) for r in conn.execute(sa.text("SHOW SLAVE HOSTS"))]
    except sa.exc.DBAPIError:  # MySQL 8.4: SHOW REPLICAS; neither is worth failing validate for
        replicas = []
    if mine in replicas:
        yield Check(p, "server_id", "fail", f"a registered replica of the source uses server_id {mine}: {fix}")
        return
    yield Check(p, "server_id", "ok", f"{mine} (the poller's replica connection)")


_GRANT = re.compile(r"^GRANT (.+?) ON \*\.\* TO", re.IGNORECASE)


def _grant_checks(conn: sa.Connection, p: str) -> Iterator[Check]:
    privileges: set[str] = set()
    for (line,) in conn.execute(sa.text("SHOW GRANTS")):
        match = _GRANT.match(str(line))
        if match:
            privileges |= {g.strip().upper() for g in match.group(1).split(",")}
    if "ALL PRIVILEGES" in privileges:
        yield Check(p, "grants", "ok", "ALL PRIVILEGES on *.*")
        return
    missing = []
    if "REPLICATION SLAVE" not in privileges and "REPLICATION REPLICA" not in privileges:
        missing.append("REPLICATION SLAVE")
    if not privileges & {"REPLICATION CLIENT", "BINLOG MONITOR"}:
        missing.append("REPLICATION CLIENT (MariaDB 10.5+: BINLOG MONITOR)")
    if missing:
        yield Check(p, "grants", "fail", f"the poller's user lacks {' and '.join(missing)} ON *.*: "
                    "GRANT REPLICATION SLAVE, REPLICATION CLIENT ON *.* TO the user (MariaDB 10.5+: "
                    "GRANT REPLICATION SLAVE, BINLOG MONITOR)")  # fmt: skip
        return
    named = privileges & {"REPLICATION SLAVE", "REPLICATION REPLICA", "REPLICATION CLIENT", "BINLOG MONITOR"}
    yield Check(p, "grants", "ok", ", ".join(sorted(named)))


def _table_checks(conn: sa.Connection, cfg: PollerConfig) -> Iterator[Check]:
    for table in sorted(qualified_tables(cfg, sa.make_url(cfg.source_url).database)):
        schema, _, name = table.partition(".")
        row = conn.execute(
            sa.text(
                "SELECT EXISTS (SELECT 1 FROM information_schema.TABLES WHERE TABLE_SCHEMA = :s AND TABLE_NAME = :t),"
                " EXISTS (SELECT 1 FROM information_schema.TABLE_CONSTRAINTS WHERE TABLE_SCHEMA = :s"
                " AND TABLE_NAME = :t AND CONSTRAINT_TYPE = 'PRIMARY KEY')"
            ),
            {"s": schema, "t": name},
        ).first()
        if row is None or not row[0]:
            yield Check(cfg.name, "table", "fail", f"table {table} does not exist")
        elif not row[1] and not cfg.pk:
            yield Check(cfg.name, "table", "fail", f"{table} has no primary key: add one, or set pk")
        else:
            yield Check(cfg.name, "table", "ok", f"{table}")


def _signal_check(conn: sa.Connection, cfg: PollerConfig, fix: bool) -> Iterator[Check]:
    """The snapshot signal table (watermarks and `dbfanout snapshot` requests, read from the binlog)."""
    try:
        table = signal_table(cfg)
    except ConfigError as exc:  # no database to put it in
        yield Check(cfg.name, "signal table", "fail", str(exc))
        return
    (create,) = mysql_signal_sql(cfg)
    schema, _, name = table.partition(".")
    engines = conn.execute(
        sa.text("SELECT TABLE_NAME, ENGINE FROM information_schema.TABLES WHERE TABLE_SCHEMA = :s AND TABLE_NAME = :t"),
        {"s": schema, "t": name},
    )
    engine = next((str(e) for n, e in engines if n == name), None)  # the collation ignores case: the exact one
    if engine is not None and engine.lower() != "innodb":
        yield Check(cfg.name, "signal table", "fail", f"{table} is {engine}: snapshots need InnoDB (its commits "
                    f"are in binlog order): ALTER TABLE {quote_mysql(table)} ENGINE=InnoDB")  # fmt: skip
    elif engine is not None:
        yield Check(cfg.name, "signal table", "ok", f"{table} exists")
    elif fix:
        conn.execute(sa.text(create))
        conn.commit()
        yield Check(cfg.name, "signal table", "ok", f"created: {create}")
    else:
        status: Status = "fail" if cfg.snapshot == "initial" else "warn"
        fix_it = f"run `dbfanout validate --fix`, or: {create}"
        yield Check(cfg.name, "signal table", status, f"{table} does not exist (snapshots need it): {fix_it}")


def _stream_check(cfg: PollerConfig) -> Iterator[Check]:
    """Open a replication stream at the binlog's end, as the poller's ticks do. Its snapshot is not
    started (``snapshot = "initial"`` would make the first page a chunk of rows, with no position to
    read on from), and a quiet server (no write since) still gets a stream opened and read."""
    source = MysqlBinlogSource(dataclasses.replace(cfg, snapshot="never"))
    try:
        start = source.fetch(None, 1).end
        if start is None:
            why = "the binlog's end could not be read (SHOW MASTER STATUS gave no position)"
            yield Check(cfg.name, "stream", "fail", f"{why}: check log_bin and the REPLICATION CLIENT grant")
            return
        source.fetch(start, 1)
        opened = source.streams_opened
    finally:
        source.close()
    if not opened:
        yield Check(cfg.name, "stream", "warn", "no replication stream was opened (nothing to read): not checked")
        return
    yield Check(cfg.name, "stream", "ok", f"read the binlog as replica {cfg.server_id}")

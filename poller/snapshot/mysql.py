"""The MySQL/MariaDB SQL of DBLog snapshots for ``kind = "mysql_binlog"`` pollers.

:class:`MysqlChunkReader` is :class:`~poller.snapshot.chunks.BaseChunkReader` on MySQL/MariaDB (primary
keys, estimates, columns, ``where`` checks, the signal table's presence, chunk reads with their
high watermark), as :class:`poller.snapshot.postgres.ChunkReader` is on PostgreSQL, so the snapshot
coordinator drives either. Imported only by mysql_binlog pollers and the CLI paths for them.

The window on MySQL/MariaDB. A chunk read is three steps on one connection:

1. **the barrier**: an upsert of this poller's ``kind = 'barrier'`` signal row, committed by
   itself (a fresh id, so it is a real change that goes through the binlog's group commit);
2. ``START TRANSACTION WITH CONSISTENT SNAPSHOT`` (REPEATABLE READ): the read view is taken now;
   the chunk is selected by keyset on the primary key (``(pk) > (last key) ORDER BY pk LIMIT n+1``,
   the row comparison written out term by term so MariaDB reads a range of the key, plus the
   request's ``where``) and, when it has rows, the *high watermark* (``kind =
   'watermark'``, ``id`` = the chunk's id) is upserted in the same transaction, which commits.

Why this is DBLog's guarantee here. The server commits transactions to InnoDB in the order it
writes them to the binlog: MySQL when ``binlog_order_commits = ON`` (its default: the commit stage
of the binlog group commit commits each group's transactions in binlog order), MariaDB by design
(its group commit calls the engines' ``commit_ordered`` in binlog order; that is where InnoDB
makes a transaction visible, and what makes MariaDB's ``START TRANSACTION WITH CONSISTENT
SNAPSHOT`` consistent with a binlog position). So:

* the barrier's commit returns only after every transaction before it in the binlog is committed
  in InnoDB, hence visible to the read view taken after it: a change the snapshot cannot see is
  *after* the barrier in the binlog. The window starts at ``start``, where the coordinator's stream
  stood before the read (at or before the binlog's end, so before the barrier): every change the
  select did not see is in the window or after it. Without the barrier a transaction already read
  from the binlog (before ``start``) but not yet committed in InnoDB would be missed by the select
  and its key emitted with the older value after it — PostgreSQL's read refuses a "racy" snapshot
  for the same reason;
* every change the select saw was committed before the read view, hence before the watermark's
  commit, hence before the watermark in the binlog;
* so, as on PostgreSQL, a chunk row emitted at the watermark comes after every change it reflects
  and every change of its key read in the window (those keys are dropped), and before every later
  change: it never overwrites a newer change, and a key deleted meanwhile is not resurrected.

With ``binlog_order_commits = OFF`` (MySQL only) the barrier proves nothing: ``dbfanout validate``
should refuse snapshots then (MariaDB has no such setting). A read never returns None here (the
barrier replaces PostgreSQL's refusal of a racy snapshot); the signature keeps it for the interface.

TIMESTAMP columns are read in UTC (the session's ``time_zone`` is set for the read), as the binlog
carries them: a chunk row has the values (and key) the stream's events of the same row have.

A row's version (what a re-read of the same unchanged row in one snapshot run gets the same event
id from; PostgreSQL's is its ``xmin``) is a hash of its column names and values: InnoDB exposes no
row version. Tuples are shaped as PostgreSQL's: the row's columns, the version, a flag (false).

The signal table is the same rows as PostgreSQL's (``poller``, ``kind``, ``id``, ``data`` as JSON,
``written_at``), so :func:`poller.snapshot.requests.signal_of` and :func:`~poller.snapshot.requests.apply_request`
read what the binlog carries. It lives in the source database: ``signal_table``'s default schema
``public`` (PostgreSQL's) means the source URL's database here.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Iterable, Sequence
from typing import Any, Unpack

import orjson
import sqlalchemy as sa

from poller.snapshot.chunks import BaseChunkReader, Chunk
from poller.snapshot.requests import KIND_WATERMARK, Request, request_params
from poller.snapshot.values import mysql_rows
from poller.sql import fetch_tuples
from shared.codec import dumps, encode_value
from shared.config import PollerConfig
from shared.errors import ConfigError, SourceError

__all__ = [
    "KIND_BARRIER",
    "MysqlChunkReader",
    "mysql_request_statement",
    "mysql_signal_sql",
    "quote_mysql",
    "row_version",
    "row_versions",
    "signal_table",
]

KIND_BARRIER = "barrier"
#: ``signal_table``'s schema when none was configured (the config's PostgreSQL default).
_DEFAULT_SCHEMA = "public"

# information_schema compares names case-insensitively (its collation): the rows carry the names,
# and the exact one is picked in Python (two tables may differ in case only).
_PRIMARY_KEY = sa.text(
    "SELECT TABLE_NAME, COLUMN_NAME FROM information_schema.KEY_COLUMN_USAGE"
    " WHERE TABLE_SCHEMA = :s AND TABLE_NAME = :t AND CONSTRAINT_NAME = 'PRIMARY' ORDER BY ORDINAL_POSITION"
)
_COLUMNS = sa.text(
    "SELECT TABLE_NAME, COLUMN_NAME FROM information_schema.COLUMNS"
    " WHERE TABLE_SCHEMA = :s AND TABLE_NAME = :t ORDER BY ORDINAL_POSITION"
)
# InnoDB's estimate (sampled statistics), NULL for a view.
_ESTIMATE = sa.text(
    "SELECT TABLE_NAME, TABLE_ROWS FROM information_schema.TABLES WHERE TABLE_SCHEMA = :s AND TABLE_NAME = :t"
)
_EXISTS = sa.text(
    "SELECT TABLE_NAME, ENGINE FROM information_schema.TABLES WHERE TABLE_SCHEMA = :s AND TABLE_NAME = :t"
)
# VALUES(col), not MySQL 8's row alias: MariaDB has only this form (MySQL 8.0.20+ warns, still runs it).
_UPSERT = (
    "INSERT INTO {table} (poller, kind, id, data, written_at) VALUES (:poller, :kind, :id, :data, NOW(6))"
    " ON DUPLICATE KEY UPDATE id = VALUES(id), data = VALUES(data), written_at = VALUES(written_at)"
)


def quote_mysql(name: str) -> str:
    """A table: ``shop.Order`s`` → `` `shop`.`Order``s` `` (split at the first dot: the config allows one)."""
    return ".".join(map(_ident, name.split(".", 1)))


def _ident(name: str) -> str:
    """One identifier (a column: a dot in it is part of the name)."""
    return "`" + name.replace("`", "``") + "`"


def signal_table(config: PollerConfig) -> str:
    """The poller's signal table as ``database.table``: ``public.x`` (the config's default schema)
    is ``x`` in the source URL's database."""
    schema, _, name = config.signal_table.rpartition(".")
    if schema and schema != _DEFAULT_SCHEMA:
        return config.signal_table
    database = sa.make_url(config.source_url).database
    if not database:
        raise ConfigError(
            f"pollers.{config.name}.signal_table",
            f"{config.signal_table!r} names no database and the source_url names none",
            hint='name it "shop.dbfanout_signal", or put the database in the URL (mysql+pymysql://user@host/shop)',
        )
    return f"{database}.{name}"


def mysql_signal_sql(config: PollerConfig) -> list[str]:
    """The signal table (shared by the pollers of a database; each reads its own rows). InnoDB: the
    barrier relies on its commit order; utf8mb4: a request's JSON may hold any text."""
    table = quote_mysql(signal_table(config))
    return [
        f"CREATE TABLE IF NOT EXISTS {table} ("
        " poller VARCHAR(200) NOT NULL, kind VARCHAR(32) NOT NULL, id VARCHAR(200) NOT NULL, data TEXT NOT NULL,"
        " written_at TIMESTAMP(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6), PRIMARY KEY (poller, kind))"
        " ENGINE=InnoDB DEFAULT CHARSET=utf8mb4"
    ]


def mysql_request_statement(config: PollerConfig, **request: Unpack[Request]) -> tuple[sa.TextClause, dict[str, Any]]:
    """:func:`poller.snapshot.postgres.request_statement` for MySQL/MariaDB: the same row (one per poller, a
    new request replaces one not yet started), written with ``INSERT ... ON DUPLICATE KEY UPDATE``."""
    params = request_params(config, **request)
    return _upsert(config), params


def _upsert(config: PollerConfig) -> sa.TextClause:
    return sa.text(_UPSERT.format(table=quote_mysql(signal_table(config))))


def row_version(names: Sequence[str], row: Sequence[Any]) -> str:
    """A stable digest of a row's columns and values (the same row read again gives the same one)."""
    return row_versions(names, [row])[0]


def row_versions(names: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    """:func:`row_version` of each row. orjson writes the values (the driver's types: numbers,
    text, dates and times natively; Decimal, bytes and the like through :func:`_plain`): a column
    has one type, so its values' texts cannot collide. A fifth of a chunk's cost with the codec's
    tagged encoding instead; the tagged one is the fallback for what orjson refuses (a huge integer)."""
    base = hashlib.blake2b(dumps(list(names)), digest_size=12)
    out: list[str] = []
    for row in rows:
        digest = base.copy()
        try:
            digest.update(orjson.dumps(row, default=_plain))
        except TypeError:
            digest.update(dumps([encode_value(value) for value in row]))
        out.append(digest.hexdigest())
    return out


def _plain(value: Any) -> str:
    return value.hex() if isinstance(value, bytes | bytearray) else str(value)


def _split(table: str) -> dict[str, str]:
    schema, _, name = table.partition(".")
    return {"s": schema, "t": name}


class MysqlChunkReader(BaseChunkReader):
    """The SQL of a snapshot on MySQL/MariaDB: primary keys, chunk selects, barrier and watermark writes.

    Tables are ``schema.table`` (:func:`poller.sources.mysql_binlog.source.qualified_tables` qualifies the
    poller's). See the module docstring for the window.
    """

    _NO_PK = "it has no primary key (or does not exist)"

    def __init__(self, config: PollerConfig, engine: sa.Engine) -> None:
        super().__init__(config, engine)
        self._signal = signal_table(config)

    def check_published(self) -> None:
        """The watermarks and requests reach the poller through the binlog: the signal table must
        exist (every InnoDB table's changes are in the binlog; nothing to publish)."""
        if self._published:
            return
        with self._engine.connect() as conn:
            found = _exact(conn.execute(_EXISTS, _split(self._signal)), self._signal)
            conn.rollback()
        if not found:
            raise SourceError(
                f"poller {self._config.name}: a snapshot needs the signal table {self._signal}, which does not exist",
                hint="run `dbfanout validate --fix` (it creates the table)",
            )
        if str(found[0] or "").lower() != "innodb":
            raise SourceError(
                f"poller {self._config.name}: the signal table {self._signal} is {found[0]}, not InnoDB: a snapshot "
                "needs its writes committed in binlog order",
                hint=f"ALTER TABLE {quote_mysql(self._signal)} ENGINE=InnoDB",
            )
        self._published = True

    def _primary_key(self, conn: sa.Connection, table: str) -> Iterable[str]:
        return _exact(conn.execute(_PRIMARY_KEY, _split(table)), table)

    def _estimate(self, conn: sa.Connection, table: str) -> int | None:
        """InnoDB's estimate (None for a view, or no such table)."""
        rows = _exact(conn.execute(_ESTIMATE, _split(table)), table)
        return rows[0] if rows else None

    def _column_names(self, conn: sa.Connection, table: str) -> Iterable[str]:
        return _exact(conn.execute(_COLUMNS, _split(table)), table)

    def _after_key(self, pk: Sequence[str]) -> str:
        """``(a, b) > (:k0, :k1)`` written out as ``a > :k0 OR (a = :k0 AND b > :k1)``: MariaDB (10.11)
        does not use the key's range for a row comparison and scans the table from its start for every
        chunk; the written-out form is a range on the primary key on MariaDB and MySQL alike."""
        quoted = [_ident(p) for p in pk]
        terms = [
            "(" + " AND ".join([*(f"{q} = :k{j}" for j, q in enumerate(quoted[:i])), f"{quoted[i]} > :k{i}"]) + ")"
            for i in range(len(quoted))
        ]
        return "(" + " OR ".join(terms) + ")"

    def _select(
        self,
        conn: sa.Connection,
        table: str,
        pk: Sequence[str],
        conditions: Sequence[str],
        params: dict[str, Any],
        chunk_id: str,
    ) -> tuple[tuple[str, ...], Sequence[Any]]:
        """Commit a barrier, then select the chunk in a consistent snapshot (see the module
        docstring): never refused, the barrier replaces PostgreSQL's refusal of a racy snapshot."""
        select = sa.text(
            f"SELECT * FROM {quote_mysql(table)} WHERE {' AND '.join(conditions) or 'TRUE'}"
            f" ORDER BY {', '.join(map(_ident, pk))} LIMIT :n"
        )
        # TIMESTAMP values as the binlog carries them (UTC), not in the session's zone: a chunk
        # row must equal the stream's image of the same row (its values, and its key).
        conn.exec_driver_sql("SET time_zone = '+00:00'")
        conn.execute(_upsert(self._config), self._signal_params(KIND_BARRIER, uuid.uuid4().hex))
        conn.commit()  # returns once every transaction before it in the binlog is visible
        conn.exec_driver_sql("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")  # the next transaction's
        conn.exec_driver_sql("START TRANSACTION WITH CONSISTENT SNAPSHOT")
        result = conn.execute(select, params)
        names, cursor = tuple(result.keys()), result.cursor  # (fetch_tuples closes the result)
        return names, mysql_rows(cursor, fetch_tuples(result))  # BIT and SET as the stream gives them

    def _tuples(self, names: tuple[str, ...], rows: Sequence[Any]) -> Sequence[Any]:
        """The rows shaped as PostgreSQL's: the columns, the row's version (a hash), a flag (false)."""
        return [(*row, version, False) for row, version in zip(rows, row_versions(names, rows), strict=True)]

    def _write_watermark(self, conn: sa.Connection, chunk: Chunk) -> None:
        conn.execute(_upsert(self._config), self._signal_params(KIND_WATERMARK, chunk.id))

    def _signal_params(self, kind: str, signal_id: str) -> dict[str, Any]:
        return {"poller": self._config.name, "kind": kind, "id": signal_id, "data": "{}"}


def _exact(result: sa.CursorResult[Any], table: str) -> list[Any]:
    """The second column of the rows whose first (TABLE_NAME) is exactly ``table``'s name."""
    name = table.partition(".")[2]
    return [row[1] for row in map(tuple, result) if row[0] == name]

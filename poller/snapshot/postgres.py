"""PostgreSQL's SQL of DBLog snapshots for ``kind = "pg_logical"`` pollers.

:class:`ChunkReader` is :class:`~poller.snapshot.chunks.BaseChunkReader` on PostgreSQL: the catalog
queries, and a chunk read as one statement (one snapshot) that selects the chunk and writes its
high watermark, refusing the snapshot when a transaction it cannot see is already committed (see
:mod:`poller.snapshot.chunks`, "the low watermark"). A row's version is its ``xmin``. Also here:
the signal table's DDL (:func:`signal_sql`) and a request row's upsert (:func:`request_statement`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Unpack

import sqlalchemy as sa

from poller.snapshot.chunks import BaseChunkReader
from poller.snapshot.requests import KIND_WATERMARK, Request, request_params
from poller.snapshot.values import postgres_rows
from poller.sql import fetch_tuples
from shared.config import PollerConfig
from shared.errors import SourceError

__all__ = ["XMIN", "ChunkReader", "quote_table", "request_statement", "signal_sql"]

XMIN = "dbfanout_xmin__"  # the row version, selected beside the row's columns

_PRIMARY_KEY = sa.text(
    "SELECT a.attname FROM pg_index i CROSS JOIN LATERAL unnest(i.indkey) WITH ORDINALITY AS k(attnum, n)"
    " JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum"
    " WHERE i.indrelid = to_regclass(:table) AND i.indisprimary ORDER BY k.n"
)
_COLUMNS = sa.text(
    "SELECT attname FROM pg_attribute WHERE attrelid = to_regclass(:table) AND attnum > 0 AND NOT attisdropped"
)
# The planner's row count; for a table never analysed (reltuples -1), the statistics' live rows.
_ESTIMATE = sa.text(
    "SELECT CAST(CASE WHEN c.reltuples >= 0 THEN c.reltuples ELSE COALESCE(s.n_live_tup, 0) END AS bigint)"
    " FROM pg_class c LEFT JOIN pg_stat_user_tables s ON s.relid = c.oid WHERE c.oid = to_regclass(:table)"
)
# A chunk, in one statement (one snapshot): its rows in key order, each with its version (its
# xmin) and the racy flag; and its high watermark, written when it has rows and is not racy. Racy:
# a transaction the snapshot cannot see is already committed, so its commit may precede the window
# (see poller.snapshot.chunks, "the low watermark"); the rows are refused then. An empty chunk cannot be stale: the flag
# does not matter when no row comes. (A scalar subquery, not EXISTS: the planner drops the ORDER
# BY and LIMIT of an EXISTS and may scan the table from its start.) txid_* exist from PostgreSQL
# 10 on.
_CHUNK = (
    "WITH dbfanout_racy__ AS (SELECT EXISTS (SELECT 1 FROM txid_snapshot_xip(txid_current_snapshot()) AS x(xid)"
    "  WHERE txid_status(x.xid) = 'committed') AS racy),"
    " dbfanout_mark__ AS (INSERT INTO {signal} (poller, kind, id, data, written_at)"
    "  SELECT :poller, '" + KIND_WATERMARK + "', :id, '{{}}', now()"
    "  WHERE NOT (SELECT racy FROM dbfanout_racy__)"
    "  AND (SELECT 1 FROM {table} WHERE {where} ORDER BY {cols} LIMIT 1) IS NOT NULL"
    "  ON CONFLICT (poller, kind) DO UPDATE SET id = EXCLUDED.id, data = EXCLUDED.data,"
    "  written_at = EXCLUDED.written_at)"
    " SELECT *, CAST(xmin AS text) AS " + XMIN + ", (SELECT racy FROM dbfanout_racy__) AS dbfanout_racy__"
    " FROM {table} WHERE {where} ORDER BY {cols} LIMIT :n"
)
_PUBLISHED = sa.text(
    "SELECT 1 FROM pg_publication_tables WHERE pubname = :pub AND schemaname || '.' || tablename = :table"
)


def quote_table(name: str) -> str:
    """A name as PostgreSQL quotes it, part by part: ``shop.Orders`` → ``"shop"."Orders"``."""
    return ".".join('"' + part.replace('"', '""') + '"' for part in name.split("."))


def signal_sql(config: PollerConfig) -> list[str]:
    """The signal table (shared by the pollers of a database; each reads its own rows)."""
    table = quote_table(config.signal_table)
    return [
        f"CREATE TABLE IF NOT EXISTS {table} ("
        " poller text NOT NULL, kind text NOT NULL, id text NOT NULL, data text NOT NULL DEFAULT '{}',"
        " written_at timestamptz NOT NULL DEFAULT now(), PRIMARY KEY (poller, kind))"
    ]


_UPSERT = (
    "INSERT INTO {table} (poller, kind, id, data, written_at) VALUES (:poller, :kind, :id, :data, now())"
    " ON CONFLICT (poller, kind) DO UPDATE SET id = EXCLUDED.id, data = EXCLUDED.data,"
    " written_at = EXCLUDED.written_at"
)


def request_statement(config: PollerConfig, **request: Unpack[Request]) -> tuple[sa.TextClause, dict[str, Any]]:
    """The statement (and its parameters) that asks a running poller for a snapshot, or cancels it.

    One row per poller (a new request replaces one not yet started); the poller reads it from its
    slot, in order with the changes.
    """
    params = request_params(config, **request)
    return sa.text(_UPSERT.format(table=quote_table(config.signal_table))), params


class ChunkReader(BaseChunkReader):
    """The SQL of a snapshot on PostgreSQL: primary keys, chunk selects and watermark writes."""

    def check_published(self) -> None:
        """The high watermark must reach the slot: the signal table must be in the publication."""
        if self._published:
            return
        with self._engine.connect() as conn:
            found = conn.execute(
                _PUBLISHED, {"pub": self._config.publication, "table": self._config.signal_table}
            ).first()
        if found is None:
            raise SourceError(
                f"poller {self._config.name}: a snapshot needs the signal table {self._config.signal_table} in "
                f"publication {self._config.publication}",
                hint="run `dbfanout validate --fix` (it creates the table and adds it to the publication)",
            )
        self._published = True

    def _primary_key(self, conn: sa.Connection, table: str) -> Iterable[str]:
        # A quoted name: a mixed-case table is found as it is.
        return conn.execute(_PRIMARY_KEY, {"table": quote_table(table)}).scalars()

    def _estimate(self, conn: sa.Connection, table: str) -> int | None:
        return conn.execute(_ESTIMATE, {"table": quote_table(table)}).scalar()

    def _column_names(self, conn: sa.Connection, table: str) -> Iterable[str]:
        return conn.execute(_COLUMNS, {"table": quote_table(table)}).scalars()

    def _after_key(self, pk: Sequence[str]) -> str:
        binds = ", ".join(f":k{i}" for i in range(len(pk)))
        return f"({', '.join(quote_table(p) for p in pk)}) > ({binds})"

    def _select(
        self,
        conn: sa.Connection,
        table: str,
        pk: Sequence[str],
        conditions: Sequence[str],
        params: dict[str, Any],
        chunk_id: str,
    ) -> tuple[tuple[str, ...], Sequence[Any]] | None:
        """One statement (one snapshot) selects the chunk and writes the watermark row; the
        transaction commits after it (:meth:`commit_watermark`), so the watermark comes in the log
        after every change the select saw, as DBLog's separate write does, and every change it
        did not see but that committed first is inside the window. The same statement refuses its
        snapshot (None) when a change it cannot see is already committed."""
        statement = sa.text(
            _CHUNK.format(
                table=quote_table(table),
                where=" AND ".join(conditions) or "true",
                cols=", ".join(quote_table(p) for p in pk),
                signal=quote_table(self._config.signal_table),
            )
        )
        result = conn.execute(statement, {**params, "poller": self._config.name, "id": chunk_id})
        names = tuple(result.keys())[:-2]  # the row's columns, then the xmin and the racy flag
        description = result.cursor.description  # (fetch_tuples closes the result)
        fetched = postgres_rows(conn, description, fetch_tuples(result))  # a domain as its base type
        if fetched and fetched[0][-1]:  # a change the select cannot see is already committed
            return None
        return names, fetched

"""The transactional outbox, application side: the table's shape and the call that writes a change.

An application that wants every change delivered — hard deletes and each intermediate update,
in order — writes one outbox row per change **in the same transaction as its business write**;
a ``kind = "outbox"`` poller reads the table in commit order and delivers one event per row::

    from shared.outbox import write_change

    with engine.begin() as conn:                      # or a Session: session.commit() commits both
        conn.execute(orders.delete().where(orders.c.id == 42))
        write_change(conn, aggregate="42", type="delete")

The event: ``pk = {"aggregate": <aggregate>}``, ``cursor`` = the outbox ``id``, ``after`` = the
payload (a JSON object, or None), ``change`` = the row's ``type``, and ``op = "delete"`` when the
type is ``delete`` or ends in ``.delete``/``.deleted`` (``"upsert"`` otherwise).

This module needs SQLAlchemy only (a core dependency): the application imports it without the
CLI extra. The table: :func:`outbox_ddl` (or ``docs/outbox.md``) per dialect.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, Protocol

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import Session

from shared.codec import dumps, encode_value

__all__ = [
    "COLUMNS",
    "DEFAULT_TABLE",
    "create_outbox",
    "is_delete",
    "outbox_ddl",
    "write_change",
]

DEFAULT_TABLE = "dbfanout_outbox"
#: The columns every dialect has; PostgreSQL adds ``txid`` (xid8), the transaction-id horizon.
COLUMNS = ("id", "aggregate", "type", "payload", "created_at")
MAX_AGGREGATE = 255
MAX_TYPE = 64


class _Executes(Protocol):
    """A Connection or an ORM Session: anything that runs a statement in the caller's transaction."""

    def execute(self, statement: Any, parameters: Any = ..., /) -> Any: ...


def is_delete(change_type: str) -> bool:
    """Whether an outbox ``type`` means the aggregate is gone (the event's ``op = "delete"``)."""
    return change_type == "delete" or change_type.endswith((".delete", ".deleted"))


def write_change(
    target: sa.Connection | Session | _Executes,
    table: str = DEFAULT_TABLE,
    *,
    aggregate: str | int,
    type: str,  # the column's name, on purpose
    payload: Mapping[str, Any] | None = None,
) -> None:
    """Insert one change into the outbox, in ``target``'s current transaction (never commits).

    ``aggregate`` names the changed entity (its key, e.g. ``"42"`` or ``"order:42"``); ``type``
    the change (``"insert"``, ``"update"``, ``"delete"``, ``"order.shipped"`` ...); ``payload``
    what the handler needs (a JSON object; datetimes, decimals, UUIDs and bytes are written in
    their readable string forms). The id and ``created_at`` come from the database, so the order
    is the database's.
    """
    aggregate = str(aggregate)
    if not aggregate or len(aggregate) > MAX_AGGREGATE:
        raise ValueError(f"aggregate must be 1 to {MAX_AGGREGATE} characters (got {len(aggregate)})")
    if not isinstance(type, str) or not type or len(type) > MAX_TYPE:
        raise ValueError(f"type must be a string of 1 to {MAX_TYPE} characters (got {type!r})")
    if payload is not None and not isinstance(payload, Mapping):
        raise TypeError(f"payload must be a mapping (a JSON object) or None, not {payload.__class__.__name__}")
    body = None if payload is None else dumps(encode_value(dict(payload))[0]).decode()
    target.execute(_insert(table, _is_postgresql(target)), {"aggregate": aggregate, "type": type, "payload": body})


def _is_postgresql(target: Any) -> bool:
    bind = target.get_bind() if isinstance(target, Session) else getattr(target, "engine", None)
    return bind is not None and bind.dialect.name == "postgresql"


@functools.lru_cache(maxsize=64)
def _insert(table: str, postgresql: bool) -> sa.Insert:
    """One INSERT per table, built once: a statement object keeps its compiled form cached."""
    schema, _, name = table.rpartition(".")
    payload: sa.ColumnElement[Any] = sa.bindparam("payload", type_=sa.String())
    if postgresql:
        payload = sa.cast(payload, JSONB)  # text is not implicitly jsonb
    outbox = sa.table(name, sa.column("aggregate"), sa.column("type"), sa.column("payload"), schema=schema or None)
    return outbox.insert().values(aggregate=sa.bindparam("aggregate"), type=sa.bindparam("type"), payload=payload)


def outbox_ddl(dialect: str, table: str = DEFAULT_TABLE) -> list[str]:
    """The statements that create the outbox table and its index on ``dialect``.

    ``postgresql``: identity id, jsonb payload, and a ``txid xid8`` column stamped with the
    writing transaction, read with the snapshot horizon (no settle window needed) through the
    ``(txid, id)`` index. ``mysql``/``mariadb`` and ``sqlite``: auto-increment id (never reused,
    even after pruning) and an index on ``created_at`` for the settle window; ``created_at`` is UTC
    whatever the writer's session time zone (a DATETIME, not a TIMESTAMP: no 2038 limit).
    """
    index = f"ix_{table.rpartition('.')[2]}"
    if dialect == "postgresql":
        return [
            f"CREATE TABLE {table} (\n"
            "  id         bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,\n"
            f"  aggregate  varchar({MAX_AGGREGATE}) NOT NULL,\n"
            f"  type       varchar({MAX_TYPE}) NOT NULL,\n"
            "  payload    jsonb,\n"
            "  created_at timestamptz NOT NULL DEFAULT now(),\n"
            "  txid       xid8 NOT NULL DEFAULT pg_current_xact_id()\n"
            ")",
            f"CREATE INDEX {index}_txid ON {table} (txid, id)",
        ]
    if dialect in ("mysql", "mariadb"):
        return [
            f"CREATE TABLE {table} (\n"
            "  id         BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY,\n"
            f"  aggregate  VARCHAR({MAX_AGGREGATE}) NOT NULL,\n"
            f"  type       VARCHAR({MAX_TYPE}) NOT NULL,\n"
            "  payload    JSON,\n"
            "  created_at DATETIME(6) NOT NULL DEFAULT (UTC_TIMESTAMP(6))\n"
            ") ENGINE=InnoDB",
            f"CREATE INDEX {index}_created ON {table} (created_at)",
        ]
    if dialect == "sqlite":
        return [
            f"CREATE TABLE {table} (\n"
            "  id         INTEGER PRIMARY KEY AUTOINCREMENT,\n"
            "  aggregate  TEXT NOT NULL,\n"
            "  type       TEXT NOT NULL,\n"
            "  payload    JSON,\n"
            "  created_at TEXT NOT NULL DEFAULT (strftime('%Y-%m-%d %H:%M:%f', 'now'))\n"
            ")",
            f"CREATE INDEX {index}_created ON {table} (created_at)",
        ]
    raise ValueError(f"no outbox DDL for the {dialect} dialect (PostgreSQL, MariaDB/MySQL and SQLite have one)")


def create_outbox(conn: sa.Connection, table: str = DEFAULT_TABLE) -> None:
    """Create the outbox table and its index (in ``conn``'s transaction; commit it yourself)."""
    for statement in outbox_ddl(conn.dialect.name, table):
        conn.exec_driver_sql(statement)

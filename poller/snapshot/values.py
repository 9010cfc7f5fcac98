"""A MariaDB/MySQL chunk's values as the stream and keyset give the same columns (docs/types.md).

A chunk is read with ``SELECT *`` and no SQLAlchemy types: pymysql gives a ``BIT(n)`` as bytes
and a ``SET`` as its comma-separated text. The binlog gives n bits and a set: the chunk's rows
are converted to those, per column, only for the columns of those types. On PostgreSQL, a
column psycopg reads as text because the server describes a domain's type (an array of a
domain) is loaded as its base type, as the stream and keyset load it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import sqlalchemy as sa

from poller.dbtypes import base_type, bits

__all__ = ["mysql_rows", "postgres_rows"]

_BIT = 16  # pymysql.constants.FIELD_TYPE.BIT
_SET_FLAG = 2048  # pymysql.constants.FLAG.SET


def mysql_rows(cursor: Any, rows: Sequence[Any]) -> Sequence[Any]:
    """``rows`` as read by ``cursor`` (pymysql's), with BIT and SET values converted."""
    fields = getattr(getattr(cursor, "_result", None), "fields", None)
    if not fields or not rows:
        return rows
    fixes: list[tuple[int, Callable[[Any], Any]]] = []
    for i, field in enumerate(fields):
        if field.type_code == _BIT:
            fixes.append((i, _bits(int(field.length))))
        elif field.flags & _SET_FLAG:
            fixes.append((i, _set))
    if not fixes:
        return rows
    out = []
    for row in rows:
        values = list(row)
        for i, fix in fixes:
            if values[i] is not None:
                values[i] = fix(values[i])
        out.append(tuple(values))
    return out


def _loading(load: Callable[[bytes], Any]) -> Callable[[Any], Any]:
    return lambda value: load(value.encode()) if isinstance(value, str) else value


def _bits(width: int) -> Callable[[Any], Any]:
    return lambda value: bits(value, width)


def _set(value: Any) -> Any:
    if isinstance(value, bytes):
        value = value.decode()
    return set(filter(None, value.split(","))) if isinstance(value, str) else value


def postgres_rows(conn: sa.Connection, description: Any, rows: Sequence[Any]) -> Sequence[Any]:
    """``rows`` of a result ``description`` (psycopg's), with a domain's values loaded as its base type."""
    if not description or not rows:
        return rows
    from psycopg.adapt import Transformer  # psycopg is installed wherever a postgresql URL is used
    from psycopg.pq import Format

    fixes: list[tuple[int, Callable[[Any], Any]]] = []
    for i, column in enumerate(description):
        oid = column[1]
        if isinstance(oid, int) and (base := base_type(conn, oid)) != oid:
            load = Transformer(conn.connection.driver_connection).get_loader(base, Format.TEXT).load
            fixes.append((i, _loading(load)))
    if not fixes:
        return rows
    out = []
    for row in rows:
        values = list(row)
        for i, fix in fixes:
            values[i] = fix(values[i])
        out.append(tuple(values))
    return out

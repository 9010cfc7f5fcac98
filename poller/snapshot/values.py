"""A MariaDB/MySQL chunk's values as the stream and keyset give the same columns (docs/types.md).

A chunk is read with ``SELECT *`` and no SQLAlchemy types: pymysql gives a ``BIT(n)`` as bytes
and a ``SET`` as its comma-separated text. The binlog gives n bits and a set: the chunk's rows
are converted to those, per column, only for the columns of those types.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from poller.sources.keyset.values import bits

__all__ = ["mysql_rows"]

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


def _bits(width: int) -> Callable[[Any], Any]:
    return lambda value: bits(value, width)


def _set(value: Any) -> Any:
    if isinstance(value, bytes):
        value = value.decode()
    return set(filter(None, value.split(","))) if isinstance(value, str) else value

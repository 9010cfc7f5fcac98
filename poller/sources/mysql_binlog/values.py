"""Binlog row values as keyset reads the same column (docs/types.md), where the binlog library differs.

pymysqlreplication decodes a ``FLOAT`` as the float32's full binary expansion
(0.10000000149011612, where keyset reads 0.1), an empty ``BLOB``/``VARBINARY`` as ``''`` (text), an empty ``SET``
as None, a zero date (``'0000-00-00'``) as None, and a negative ``TIME(n)`` with a fraction
wrongly (``-00:00:01.000001`` as ``-00:00:01.999999``: the fraction is stored as its
complement to one second). The row dicts are fixed in place, per column, only for the columns
of those types: a table without them costs one check per event.
"""

from __future__ import annotations

import datetime as dt
import math
import struct
from collections.abc import Callable, Sequence
from typing import Any

from pymysqlreplication.constants import FIELD_TYPE

__all__ = ["fix_rows"]

_BINARY = "binary"  # the character set of BLOB, BINARY, VARBINARY (binlog_row_metadata = FULL names it)
_TEXTUAL = frozenset({FIELD_TYPE.BLOB, FIELD_TYPE.VARCHAR, FIELD_TYPE.VAR_STRING, FIELD_TYPE.STRING})
_ZERO_DATES = frozenset({FIELD_TYPE.DATE, FIELD_TYPE.DATETIME, FIELD_TYPE.DATETIME2})
_ROW_KEYS = (
    ("values", "none_sources"),
    ("before_values", "before_none_sources"),
    ("after_values", "after_none_sources"),
)
_SECOND = dt.timedelta(seconds=1)
_F32 = struct.Struct("<f")

# fix(value, why the library gave None): the value as keyset reads it
Fix = Callable[[Any, str], Any]


def fix_rows(columns: Sequence[Any], rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``rows`` (an event's, as the library decoded them) with their values as keyset reads them."""
    fixes = [
        (c.name, fix, fix in _OF_NULL or c.type in _ZERO_DATES) for c in columns if (fix := _fix_for(c)) is not None
    ]
    if not fixes:
        return rows
    for row in rows:
        for values_key, why_key in _ROW_KEYS:
            values = row.get(values_key)
            if values is None:
                continue
            why = row.get(why_key) or {}
            for name, fix, of_null in fixes:
                value = values.get(name)
                if (value is None) is of_null:  # a zero date or empty set is a None; the rest fix values
                    values[name] = fix(value, why.get(name, ""))
    return rows


def _fix_for(column: Any) -> Fix | None:
    kind = column.type
    if kind in _TEXTUAL and _BINARY in (
        getattr(column, "character_set_name", None),
        getattr(column, "collation_name", None),
    ):
        return _binary
    if kind == FIELD_TYPE.SET:
        return _set
    if kind in _ZERO_DATES:
        fsp = int(getattr(column, "fsp", 0) or 0)
        zero = "0000-00-00" if kind == FIELD_TYPE.DATE else "0000-00-00 00:00:00" + ("." + "0" * fsp if fsp else "")
        return _zero_date(zero)
    if kind == FIELD_TYPE.FLOAT:
        return _single
    if kind == FIELD_TYPE.TIME2 and getattr(column, "fsp", 0):
        return _negative_fraction
    return None


def _single(value: Any, why: str) -> Any:
    """A FLOAT as the shortest decimal that is the same single-precision number (0.1, not 0.10000000149011612)."""
    if not isinstance(value, float) or not math.isfinite(value):
        return value
    for digits in range(1, 10):  # 9 significant digits identify every float32
        short = float(f"{value:.{digits}g}")
        if _F32.unpack(_F32.pack(short))[0] == value:
            return short
    return value


def _binary(value: Any, why: str) -> Any:
    return value.encode() if isinstance(value, str) else value  # the library's utf-8 decoding, undone


def _set(value: Any, why: str) -> Any:
    return set() if value is None and why == "empty set" else value


def _zero_date(zero: str) -> Fix:
    def fix(value: Any, why: str) -> Any:
        return zero if value is None and why.startswith("out of date") else value

    return fix


def _negative_fraction(value: Any, why: str) -> Any:
    if not isinstance(value, dt.timedelta) or value >= dt.timedelta(0) or not value.microseconds:
        return value
    whole = dt.timedelta(seconds=(-value).days * 86_400 + (-value).seconds)
    return -(whole + _SECOND - dt.timedelta(microseconds=(-value).microseconds))


_OF_NULL = frozenset({_set})  # (and the zero dates'): fixes of what the library gave as None

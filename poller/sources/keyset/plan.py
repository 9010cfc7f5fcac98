"""Keyset order for a source: what kind of cursor it has, and the SQL that seeks past a position.

**Cursor kinds.** The kind is decided from the first non-NULL cursor value the database returns
(so table and query mode agree) and fixes three things: what the checkpoint stores (exactly what
the database compares, so re-binding it after a restart seeks to the same place), what the event
carries (a typed, tz-aware value), and which settle window applies (:mod:`poller.sources.keyset.late_commits`).

================  ==============================  ==============================================
kind              checkpoint (``Position.cursor``)  event value (``values[cursor]``)
================  ==============================  ==============================================
``aware``         tz-aware datetime               the same
``naive``         naive datetime (as stored)      made tz-aware with ``cursor_timezone``
``date``          date                            the same
``text_datetime`` SQLite: the stored TEXT, raw    parsed, tz-aware (``cursor_timezone`` if naive)
``text_date``     SQLite: the stored TEXT, raw    parsed date
``number``        int / Decimal                   the same
``float``         float (warned: precision)       the same
``text``          str                             the same
``uuid``/``bytes`` the value                      the same
================  ==============================  ==============================================

**Why SQLite keeps the raw text.** SQLite has no datetime type: a DATETIME column holds TEXT, and
``<``/``ORDER BY`` compare that text byte by byte. Binding a Python datetime renders it as
``'YYYY-MM-DD HH:MM:SS.ffffff'``; a row stored as ``'2026-01-01 10:00:00'`` (no micros) or with a
``'T'`` then compares *differently* from how ORDER BY sorted it, and rows sharing the checkpoint's
timestamp with a higher pk are skipped forever. Keeping the stored text as the position makes the
comparison the very one ORDER BY used. (A column mixing formats, e.g. some values with ``'T'`` and
some with ``' '``, is not chronological as text at all: keep one format; a WARNING is logged.)

**The seek predicate.** ``(c, pk1, pk2) > (:c, :pk1, :pk2)`` is a full index condition on
PostgreSQL, but SQLite cannot seek with row values and MariaDB's optimizer turns them into a full
scan (checked with EXPLAIN in ``tests/poller/sources/keyset/test_source_explain.py``). Elsewhere we expand it
lexicographically with a sargable leading range::

    c >= :c AND (c > :c OR (pk1 >= :pk1 AND (pk1 > :pk1 OR pk2 > :pk2)))
"""

from __future__ import annotations

import datetime as dt
import re
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, Literal
from zoneinfo import ZoneInfo

import sqlalchemy as sa

from shared.errors import CursorError
from shared.models import CursorValue

__all__ = ["CursorKind", "PredicateStyle", "after_predicate", "classify", "index_gap", "predicate_style"]

PredicateStyle = Literal["row-value", "expanded"]
Kind = Literal["aware", "naive", "date", "text_datetime", "text_date", "number", "float", "text", "uuid", "bytes"]

_ISO_DATETIME = re.compile(r"^\d{4}-\d{2}-\d{2}[ T]\d{2}:\d{2}")
_ISO_DATE = re.compile(r"^\d{4}-\d{2}-\d{2}$")

# (python value) -> (checkpoint value, event value)
Converter = Callable[[Any], tuple[Any, Any]]


@dataclass(frozen=True, slots=True)
class CursorKind:
    """How a cursor column is compared, checkpointed and delivered."""

    kind: Kind
    tz: ZoneInfo | None = None  # the zone naive values are in (cursor_timezone)
    sep: str = " "  # text_datetime: the date/time separator the stored text uses

    @property
    def temporal(self) -> bool:
        return self.kind in ("aware", "naive", "date", "text_datetime", "text_date")

    def converter(self, column: str) -> Converter:
        """The per-row conversion of a fetched cursor value."""
        if self.kind == "naive":
            tz = self.tz
            return lambda v: (v, v.replace(tzinfo=tz))
        if self.kind == "text_datetime":
            parse, suffix = dt.datetime.fromisoformat, _utc_suffix(self.tz)
            if suffix is not None:  # fast path (~5x faster than .replace(tzinfo=...)); errors re-parse slowly

                def fast(v: Any) -> tuple[Any, Any]:
                    try:  # stored text has no offset (SQLite): one parse with the zone's suffix
                        return v, parse(v + suffix)
                    except (TypeError, ValueError):  # text with its own offset, or not a timestamp
                        return v, self.parse_text(v, column)

                return fast
            return lambda v: (v, self.parse_text(v, column))
        if self.kind == "text_date":
            return lambda v: (v, _parse_date(v, column))
        return lambda v: (v, v)

    def parse_text(self, raw: Any, column: str) -> dt.datetime:
        if not isinstance(raw, str):
            raise CursorError(f"cursor column {column!r} holds {raw!r} among text timestamps")
        try:
            value = dt.datetime.fromisoformat(raw)
        except ValueError as exc:
            raise CursorError(f"cursor column {column!r} holds {raw!r}, which is not an ISO timestamp") from exc
        if value.tzinfo is None:
            if self.tz is None:
                raise _naive_error(column, raw)
            value = value.replace(tzinfo=self.tz)
        return value

    def rebind(self, value: CursorValue) -> Any:
        """A checkpoint cursor made comparable with the column again (exactly as it was fetched)."""
        if isinstance(value, dt.datetime) and value.tzinfo is not None and self.kind in ("naive", "text_datetime"):
            local = value.astimezone(self.tz) if self.tz is not None else value
            value = local.replace(tzinfo=None)
        if isinstance(value, dt.datetime) and self.kind == "text_datetime":
            return value.isoformat(self.sep)
        if isinstance(value, dt.date) and self.kind == "text_date":
            return value.isoformat()
        return value


def _utc_suffix(tz: ZoneInfo | None) -> str | None:
    """``"+00:00"`` when ``tz`` is UTC all year, else None."""
    if tz is None or any(tz.utcoffset(dt.datetime(2000, m, 1)) != dt.timedelta(0) for m in (1, 7)):
        return None
    return "+00:00"


def _parse_date(raw: Any, column: str) -> dt.date:
    try:
        return dt.date.fromisoformat(raw)
    except (TypeError, ValueError) as exc:
        raise CursorError(f"cursor column {column!r} holds {raw!r}, which is not an ISO date") from exc


def _naive_error(column: str, value: Any) -> CursorError:
    return CursorError(
        f"cursor column {column!r} holds a timestamp without a time zone ({value!r}); dbfanout will not guess "
        "which zone it is in",
        hint='set cursor_timezone (e.g. cursor_timezone = "UTC") for this poller, or use a timestamptz column',
    )


def classify(
    value: Any,
    column: str,
    *,
    sqlite_declared: str | None,
    tz: ZoneInfo | None,
) -> CursorKind:
    """The kind of a cursor column, from one of its values.

    ``sqlite_declared`` is ``"datetime"``/``"date"``/``"boolean"`` when a SQLite table declares the column so, ``""``
    for another declared type, None when unknown (query mode). Raises CursorError for a type that
    cannot be ordered safely.
    """
    if isinstance(value, bool) or sqlite_declared == "boolean":
        raise CursorError(f"cursor column {column!r} is boolean: it cannot order changes")
    if isinstance(value, dt.datetime):
        if value.tzinfo is not None:
            return CursorKind("aware")
        if tz is None:
            raise _naive_error(column, value)
        return CursorKind("naive", tz)
    if isinstance(value, dt.date):
        return CursorKind("date", tz)
    if isinstance(value, int | Decimal):
        return CursorKind("number")
    if isinstance(value, float):
        return CursorKind("float")
    if isinstance(value, uuid.UUID):
        return CursorKind("uuid")
    if isinstance(value, bytes | bytearray | memoryview):
        return CursorKind("bytes")
    if isinstance(value, str):
        return _classify_text(value, column, sqlite_declared, tz)
    raise CursorError(
        f"cursor column {column!r} has type {type(value).__name__}, which dbfanout cannot checkpoint exactly",
        hint="use an integer, numeric, timestamp, date, text or uuid cursor (cast it in a query-mode poller)",
    )


def _classify_text(value: str, column: str, sqlite_declared: str | None, tz: ZoneInfo | None) -> CursorKind:
    looks_datetime = bool(_ISO_DATETIME.match(value))
    if sqlite_declared == "date" or (sqlite_declared is None and _ISO_DATE.match(value)):
        _parse_date(value, column)
        return CursorKind("text_date", tz)
    if sqlite_declared == "datetime" or (sqlite_declared is None and looks_datetime):
        sep = value[10] if len(value) > 10 and value[10] in " T" else " "
        kind = CursorKind("text_datetime", tz, sep)
        kind.parse_text(value, column)  # naive without cursor_timezone -> CursorError now, not mid-page
        return kind
    return CursorKind("text")


def sqlite_declared_kind(type_: sa.types.TypeEngine[Any]) -> str:
    """``"datetime"``, ``"date"``, ``"boolean"`` or ``""`` for a reflected SQLite column type."""
    if isinstance(type_, sa.Boolean):
        return "boolean"
    if isinstance(type_, sa.DateTime):
        return "datetime"
    if isinstance(type_, sa.Date):
        return "date"
    name = str(getattr(type_, "__visit_name__", "")).upper()
    return "datetime" if "TIME" in name else ""


def predicate_style(dialect_name: str) -> PredicateStyle:
    """Row values seek on PostgreSQL only; the expanded form seeks everywhere else."""
    return "row-value" if dialect_name == "postgresql" else "expanded"


def after_predicate(
    columns: Sequence[sa.ColumnElement[Any]],
    params: Sequence[sa.BindParameter[Any]],
    style: PredicateStyle,
) -> sa.ColumnElement[bool]:
    """``(columns) > (params)`` lexicographically, in the form that seeks the index."""
    if style == "row-value" and len(columns) > 1:
        return sa.tuple_(*columns) > sa.tuple_(*params)
    return _expanded(list(columns), list(params))


def _expanded(columns: list[sa.ColumnElement[Any]], params: list[sa.BindParameter[Any]]) -> sa.ColumnElement[bool]:
    head, value = columns[0], params[0]
    if len(columns) == 1:
        return head > value
    return sa.and_(head >= value, sa.or_(head > value, _expanded(columns[1:], params[1:])))


def index_gap(conn: sa.Connection, table: sa.Table, wanted: list[str]) -> str | None:
    """Why no index has ``wanted`` as its leading columns, or None when one has."""
    inspector = sa.inspect(conn)
    candidates = [list(ix["column_names"]) for ix in inspector.get_indexes(table.name, schema=table.schema)]
    candidates.append(list(inspector.get_pk_constraint(table.name, schema=table.schema)["constrained_columns"]))
    try:
        uniques = inspector.get_unique_constraints(table.name, schema=table.schema)
    except NotImplementedError:  # pragma: no cover - dialects without unique-constraint reflection
        uniques = []
    candidates += [list(u["column_names"]) for u in uniques]
    if any(cols[: len(wanted)] == wanted for cols in candidates):
        return None
    columns = ", ".join(wanted)
    return (
        f"no index on {table.fullname} starts with ({columns}): every fetch scans and sorts the table; "
        f"create one: CREATE INDEX ix_{table.name}_dbfanout ON {table.fullname} ({columns})"
    )

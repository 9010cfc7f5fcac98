"""Late commits: the settle window and the PostgreSQL transaction-id horizon (DESIGN §3.5).

A cursor value is assigned *before* its transaction commits, so a row can become visible with a
cursor behind a checkpoint that has already moved past it, and a keyset poller would skip it
forever. Two defences, both evaluated by the database itself (never this process's clock):

**Settle window** (``settle_seconds``, temporal cursors). Only rows with
``cursor <= db_now - settle_seconds`` are read, so a row is read only once every transaction that
could still commit a cursor at or below it has had ``settle_seconds`` to finish. It is safe when
the cursor is assigned from the database clock inside the writing transaction (``now()`` /
``CURRENT_TIMESTAMP`` / a trigger) and **no writing transaction lasts longer than the window**.
Per dialect:

* PostgreSQL: ``now() - interval``. ``now()`` is the start of *our* fetch transaction (each fetch
  is its own short transaction), and being STABLE it can be an index condition; ``clock_timestamp()``
  is volatile (re-evaluated per row, no index use) and would only be a few milliseconds later.
  ``timestamp without time zone`` columns compare with ``timezone(cursor_timezone, now())``.
* MariaDB / MySQL: ``UTC_TIMESTAMP(6) - INTERVAL n MICROSECOND`` (the engine sets the session
  time zone to UTC), converted with ``CONVERT_TZ`` when ``cursor_timezone`` is not UTC (that needs
  the server's time zone tables: checked on first fetch).
* SQLite: ``strftime('%Y-%m-%d %H:%M:%f', 'now', '-n seconds')`` in the *stored* text format (the
  separator, ``' '`` or ``'T'``, is taken from the data), shifted to ``cursor_timezone``. SQLite is
  embedded, so its clock is this machine's.
* Date cursors: only days that ended ``settle_seconds`` ago (``cursor < date(db_now - settle)``).

**Integer, numeric, text and uuid cursors get no time-based settle** (there is no time to compare
with). A sequence value is also taken before commit, so such a cursor is only safe with a single
writer, or with the xid horizon below. The source logs a WARNING once when settle is configured
for such a cursor without ``xid_column``.

**Transaction-id horizon** (PostgreSQL, ``xid_column``). The column (type ``xid8``) is set to
``pg_current_xact_id()`` on every insert and update (DDL in ``docs/cursors.md``); the predicate
``xid_column < pg_snapshot_xmin(pg_current_snapshot())`` reads only rows whose writing transaction
is older than every transaction still running, so no running transaction can later commit a row
behind what we read. It is exact when **the cursor is the xid column itself**; with a ``now()``
timestamp cursor it is exact as long as a transaction's xid order matches its cursor order (a
transaction that starts first but writes its first row after a later one committed is the gap:
keep a settle window too). Settle 0 and no xid column disable both defences.
"""

from __future__ import annotations

import datetime as dt
from typing import Any
from zoneinfo import ZoneInfo

import sqlalchemy as sa

from poller.sources.keyset.plan import CursorKind
from shared.errors import ConfigError

__all__ = ["is_utc", "settle_predicate", "xid_horizon"]


def is_utc(tz: ZoneInfo | None) -> bool:
    if tz is None:
        return True
    return all(tz.utcoffset(dt.datetime(2000, month, 1)) == dt.timedelta(0) for month in (1, 7))


def settle_predicate(
    column: sa.ColumnElement[Any],
    dialect: str,
    kind: CursorKind,
    seconds: float,
    poller: str,
) -> sa.ColumnElement[bool] | None:
    """``column`` is older than the settle window on the database clock (None: no window applies)."""
    if seconds <= 0 or not kind.temporal:
        return None
    if dialect == "postgresql":
        return _postgresql(column, kind, seconds)
    if dialect in ("mysql", "mariadb"):
        return _mysql(column, kind, seconds)
    if dialect == "sqlite":
        return _sqlite(column, kind, seconds)
    raise ConfigError(
        f"pollers.{poller}.settle_seconds",
        f"the settle window is not implemented for the {dialect} dialect",
        hint="set settle_seconds = 0 and make sure a single transaction writes the table at a time",
    )


def _postgresql(column: sa.ColumnElement[Any], kind: CursorKind, seconds: float) -> sa.ColumnElement[bool]:
    interval: sa.ColumnElement[Any] = sa.literal_column(f"interval '{seconds:.6f} seconds'")
    now: sa.ColumnElement[Any] = sa.func.now()
    if kind.kind == "aware":
        return column <= now - interval
    local = sa.func.timezone(sa.literal(kind.tz.key), now) if kind.tz is not None else sa.func.localtimestamp()
    if kind.kind == "date":
        return column < sa.cast(local - interval, sa.Date)
    return column <= local - interval


def _mysql(column: sa.ColumnElement[Any], kind: CursorKind, seconds: float) -> sa.ColumnElement[bool]:
    micros = round(seconds * 1_000_000)
    now = "UTC_TIMESTAMP(6)"
    if not is_utc(kind.tz):
        assert kind.tz is not None
        now = f"CONVERT_TZ(UTC_TIMESTAMP(6), '+00:00', '{kind.tz.key}')"
    bound: sa.ColumnElement[Any] = sa.literal_column(f"({now} - INTERVAL {micros} MICROSECOND)")
    if kind.kind == "date":
        return column < sa.func.date(bound)
    return column <= bound


def mysql_timezone_probe(kind: CursorKind) -> str | None:
    """SQL that returns NULL when the server cannot convert to ``cursor_timezone`` (no tz tables)."""
    if kind.tz is None or is_utc(kind.tz) or not kind.temporal:
        return None
    return f"SELECT CONVERT_TZ(UTC_TIMESTAMP(6), '+00:00', '{kind.tz.key}')"


def _sqlite(column: sa.ColumnElement[Any], kind: CursorKind, seconds: float) -> sa.ColumnElement[bool]:
    modifiers = ["now", f"-{seconds:.6f} seconds"]
    if not is_utc(kind.tz):
        assert kind.tz is not None
        # SQLite's clock is this machine's; the zone's current offset turns UTC into stored local time.
        offset = dt.datetime.now(kind.tz).utcoffset() or dt.timedelta(0)
        modifiers.append(f"{offset.total_seconds():+.0f} seconds")
    if kind.kind == "text_date":
        return column < sa.func.date(*modifiers)
    fmt = f"%Y-%m-%d{kind.sep}%H:%M:%f"
    return column <= sa.func.strftime(fmt, *modifiers)


def xid_horizon(column: sa.ColumnElement[Any]) -> sa.ColumnElement[bool]:
    """Rows written by transactions older than every running one (PostgreSQL 13+, xid8 column)."""
    return column < sa.func.pg_snapshot_xmin(sa.func.pg_current_snapshot())

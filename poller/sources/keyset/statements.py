"""A keyset source's page SELECTs, built once from the resolved source and its cursor's kind.

:class:`Planner` finds the cursor's kind from its first non-NULL value (a table with none yet has
no plan) and builds the two SELECTs (first page; page after a position) with bind parameters: the
order ``(cursor, pk...)``, the seek predicate (:mod:`poller.sources.keyset.plan`), the filter, the
settle window and the xid horizon (:mod:`poller.sources.keyset.late_commits`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from zoneinfo import ZoneInfo

import sqlalchemy as sa

from poller.sources.keyset.late_commits import mysql_timezone_probe, settle_predicate, xid_horizon
from poller.sources.keyset.plan import CursorKind, after_predicate, classify, predicate_style
from poller.sources.keyset.resolve import RAW_CURSOR, Resolved
from poller.sources.keyset.table_shape import ResultShape, key_change, value_family
from shared.config import PollerConfig
from shared.errors import ConfigError

__all__ = ["Plan", "Planner"]


@dataclass(slots=True)
class Plan:
    """A page's two SELECTs and what reading their results needs."""

    kind: CursorKind
    first: sa.Select[Any]
    after: sa.Select[Any]
    family: str  # the cursor values' type family (poller.sources.keyset.table_shape.value_family)
    unprocessed: str | None  # a column read raw (SQLite text timestamps: converted by the kind)
    result: ResultShape | None = None  # set by the first result read with this plan (table mode)


class Planner:
    """Plans a source's pages; keeps the cursor's kind since the first plan (a change is an error)."""

    def __init__(self, config: PollerConfig, dialect: str, tz: ZoneInfo | None, warn_once: Callable[..., None]) -> None:
        self._config = config
        self._dialect = dialect
        self._tz = tz
        self._warn_once = warn_once  # (key, message, *args): a WARNING once per key
        self.kind: CursorKind | None = None
        self._probe: tuple[Resolved, sa.Select[Any]] | None = None  # see _probe_of

    def plan(self, conn: sa.Connection, r: Resolved) -> Plan | None:
        """The SELECTs of ``r``'s pages (None: no cursor value yet, nothing to order)."""
        sample = conn.execute(self._probe_of(r)).scalar()
        if sample is None:
            return None  # no cursor values yet: nothing to order
        kind = classify(sample, self._config.cursor, sqlite_declared=r.sqlite_declared, tz=self._tz)
        if self.kind is not None and kind.kind != self.kind.kind:
            change = f"changed the values ({self.kind.kind} -> {kind.kind}) of"
            where = str(self._config.table or "query")
            raise key_change(self._config.name, where, "cursor", self._config.cursor, change)
        self.kind = kind
        self._check_server_timezone(conn, kind)
        self._warn_kind(kind)
        cfg = self._config
        base: list[sa.ColumnElement[bool]] = []
        if r.filter is not None:
            base.append(r.filter)
        settle = settle_predicate(r.cursor, self._dialect, kind, cfg.settle_seconds, cfg.name)
        if settle is not None:
            base.append(settle)
        if cfg.xid_column:
            base.append(xid_horizon(r.from_.c[cfg.xid_column]))
        keys = [r.cursor, *r.pk]
        params = [sa.bindparam(f"k{i}", type_=k.type) for i, k in enumerate(keys)]
        seek = after_predicate(keys, params, predicate_style(self._dialect))
        columns = r.columns
        unprocessed = None
        if r.raw_extra:  # the compared (raw) cursor rides along; a text timestamp is not parsed twice
            columns = (*columns, r.cursor.label(RAW_CURSOR))
            unprocessed = cfg.cursor if kind.kind in ("text_datetime", "text_date") else None
        select = sa.select(*columns).select_from(r.from_).order_by(*keys).limit(sa.bindparam("dbf_limit"))
        return Plan(
            kind=kind,
            first=select.where(r.cursor.is_not(None), *base),
            after=select.where(seek, *base),
            family=value_family(sample),
            unprocessed=unprocessed,
        )

    def settle_text(self, kind: CursorKind | None) -> str:
        """The settle window as ``dbfanout validate`` says it."""
        cfg = self._config
        if cfg.settle_seconds <= 0:
            return "disabled (settle_seconds = 0)"
        if kind is None:
            return "unknown until the cursor column has a value"
        if not kind.temporal:
            return f"none: a {kind.kind} cursor has no time (single writer or xid_column needed)"
        return f"cursor older than {cfg.settle_seconds:g} s on the {self._dialect} clock"

    def _probe_of(self, r: Resolved) -> sa.Select[Any]:
        """The first cursor value's SELECT, built once per resolved shape: a table with no cursor
        values yet runs it at every tick, and building it cost more than running it."""
        if self._probe is None or self._probe[0] is not r:
            select = sa.select(r.cursor).select_from(r.from_).where(r.cursor.is_not(None))
            self._probe = (r, select.order_by(r.cursor).limit(1))
        return self._probe[1]

    def _check_server_timezone(self, conn: sa.Connection, kind: CursorKind) -> None:
        probe = mysql_timezone_probe(kind) if self._dialect in ("mysql", "mariadb") else None
        if probe is not None and self._config.settle_seconds > 0 and conn.execute(sa.text(probe)).scalar() is None:
            raise ConfigError(
                f"pollers.{self._config.name}.cursor_timezone",
                f"the server cannot convert to {self._config.cursor_timezone!r} (its time zone tables are empty)",
                hint="load them with mariadb-tzinfo-to-sql, or store UTC and set cursor_timezone = 'UTC'",
            )

    def _warn_kind(self, kind: CursorKind) -> None:
        cfg = self._config
        if kind.kind == "float":
            self._warn_once(
                "float",
                "cursor %r is a float: equal-looking values may compare unequal and updates within its "
                "precision collapse (W7); prefer an integer or timestamp",
                cfg.cursor,
            )
        if cfg.settle_seconds > 0 and not kind.temporal and not cfg.xid_column:
            self._warn_once(
                "settle",
                "settle_seconds does not apply to the %s cursor %r: a late-committing transaction can be skipped "
                "unless a single transaction writes at a time; set xid_column (PostgreSQL) to close the gap",
                kind.kind,
                cfg.cursor,
            )

"""The SQLAlchemy keyset source: a table or a query, read in ``(cursor, pk...)`` order.

``SqlSource(config).fetch(after, limit)`` returns the rows strictly after ``after``, oldest first,
that the database considers settled. Everything is evaluated by the database: the order, the seek
predicate (:mod:`poller.sources.keyset.plan`), the settle window and the xid horizon
(:mod:`poller.sources.keyset.late_commits`).

Lifecycle: the constructor only checks the configuration (no connection). The first ``fetch``
resolves the source (reflects the table, or checks the query's output columns), finds the cursor's
kind from its first non-NULL value, and builds the two SELECTs (first page; page after a position)
once, with bind parameters. A table with no cursor values yet returns empty pages until it has one.

Migrations (``ALTER TABLE``): a table's pages select ``*``, and each result's description is
checked against the shape the plan was made for (:mod:`poller.sources.keyset.table_shape`, at no extra query).
An added, dropped, renamed or retyped column, or a statement that fails because a column it names
is gone, makes the fetch reflect the table again, re-plan and read again: the page comes in the
table's new shape in the same tick. A change to the cursor or a key column raises
:class:`~shared.errors.SchemaChangeError` instead (an operator decision). The fingerprint covers
the configuration only (url, table/query, cursor, pk, filter...), never the column list, so a
migration needs no checkpoint reset.

NULL cursors (``null_cursor``): such rows can never be ordered against a checkpoint.

* ``"skip"`` (default): they are excluded (``cursor IS NOT NULL``) and counted; the count is a
  gauge reported on every page as ``Page.skipped_null_cursors`` and logged as a WARNING whenever it
  is refreshed and non-zero. Cost: one ``COUNT(*) ... WHERE cursor IS NULL`` (an index seek when
  ``(cursor, pk)`` is indexed), run on the first fetch and then at most once per
  ``NULL_CHECK_SECONDS`` (60 s), only on a short page (caught up), so catch-up pays nothing.
* ``"fail"``: the same check raises :class:`~shared.errors.CursorError` naming the column.

Soft deletes: a row whose ``soft_delete_column`` is not NULL, not false and not 0 is
``deleted=True`` (the column stays in the values). Hard deletes are invisible to a cursor poller.
"""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, suppress
from dataclasses import dataclass
from typing import Any, TypeVar
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import sqlalchemy as sa

from poller.ports import KeysetColumns, Page, SourceRow
from poller.sources.engines import db_errors, driver_message, is_transient, retry_disconnect, source_engine
from poller.sources.keyset.late_commits import mysql_timezone_probe, settle_predicate, xid_horizon
from poller.sources.keyset.plan import (
    CursorKind,
    after_predicate,
    classify,
    index_gap,
    predicate_style,
    sqlite_declared_kind,
)
from poller.sources.keyset.table_shape import (
    RUNBOOK,
    ResultShape,
    TableShape,
    description_signature,
    key_change,
    type_family,
    value_family,
)
from poller.sql import fetch_tuples
from shared.config import PollerConfig
from shared.errors import ConfigError, CursorError, FetchError, SchemaChangeError
from shared.ids import source_fingerprint
from shared.logs import get_logger, ids
from shared.models import Checkpoint, Position
from shared.settings import fingerprint_url, redact_url

__all__ = ["SqlSource"]

log = get_logger("poller.source")
T = TypeVar("T")

_RAW_CURSOR = "__dbfanout_cursor"
_SUBQUERY = "dbfanout_src"
#: Re-plans one fetch may make when the table changes under it (each after a re-reflection).
REPLANS_PER_FETCH = 3
# A needed column's setting -> how an error names its role.
_ROLES = {"cursor": "cursor", "pk": "pk", "soft_delete_column": "soft-delete", "xid_column": "xid"}


@dataclass(frozen=True, slots=True)
class _Resolved:
    """The source as a FROM clause, with the expressions the keyset compares."""

    from_: sa.FromClause
    cursor: sa.ColumnElement[Any]  # as compared (raw text on SQLite)
    pk: tuple[sa.ColumnElement[Any], ...]
    columns: tuple[sa.ColumnElement[Any], ...]  # what a page selects (``*``)
    raw_extra: bool  # SQLite: the compared cursor is also selected, raw, as _RAW_CURSOR
    sqlite_declared: str | None
    filter: sa.ColumnElement[bool] | None
    shape: TableShape | None  # table mode: the columns as reflected (None: a query's are its own)


@dataclass(slots=True)
class _Plan:
    kind: CursorKind
    first: sa.Select[Any]
    after: sa.Select[Any]
    family: str  # the cursor values' type family (poller.sources.keyset.table_shape.value_family)
    unprocessed: str | None  # a column read raw (SQLite text timestamps: converted by the kind)
    result: ResultShape | None = None  # set by the first result read with this plan (table mode)


class _ShapeChanged(Exception):
    """A page's result is not in the shape its plan was made for (internal: the fetch re-plans)."""

    def __init__(self, value: Any = None, *, by_value: bool = False) -> None:
        super().__init__()
        self.value, self.by_value = value, by_value


class SqlSource:
    """The :class:`~poller.ports.Source` port over a SQLAlchemy engine (pooled, shared per URL)."""

    NULL_CHECK_SECONDS = 60.0

    def __init__(self, config: PollerConfig, engine: sa.Engine | None = None) -> None:
        self._config = config
        self._engine = source_engine(config, engine, reads=True)
        self._dialect = self._engine.dialect.name
        self._url = redact_url(config.source_url)
        self._key = f"pollers.{config.name}"
        self._tz = _zone(config.cursor_timezone, f"{self._key}.cursor_timezone")
        if config.xid_column and self._dialect != "postgresql":
            raise ConfigError(f"{self._key}.xid_column", f"needs PostgreSQL 13+ (this source is {self._dialect})")
        self._fingerprint = source_fingerprint(
            {
                "url": fingerprint_url(config.source_url),
                "table": config.table,
                "query": config.query,
                "cursor": config.cursor,
                "pk": list(config.pk),
                "filter": config.filter,
                "soft_delete_column": config.soft_delete_column,
                "xid_column": config.xid_column,
            }
        )
        self._resolved: _Resolved | None = None
        self._plan: _Plan | None = None
        self._probe: tuple[_Resolved, sa.Select[Any]] | None = None  # see _probe_of
        self._kind: CursorKind | None = None  # the cursor's kind since the first plan (a change is an error)
        self._index_warning: str | None = None
        self._null_count = 0
        self._null_checked_at: float | None = None
        self._warned: set[str] = set()
        self._local = threading.local()  # the connection pinned by pinned(), per thread

    # ------------------------------------------------------------------------------ the port

    @property
    def prefetch_pages(self) -> bool:
        """Whether the tick may read the next page while it sends this one (poller.tick.prefetch).

        A keyset read has no side effects. It pays off with a database server, which runs the
        query in its own process while the driver waits without the GIL; SQLite runs it in this
        process, contending for the GIL with the encoding (measured slower: BENCHMARKS.md).
        """
        return self._dialect != "sqlite"

    @property
    def fingerprint(self) -> str:
        return self._fingerprint

    def fetch(self, after: Position | None, limit: int) -> Page:
        if not getattr(self._local, "pinning", False):
            with self._db_errors("fetch"):
                return self._read(lambda conn: self._fetch(conn, after, limit))
        with self._db_errors("fetch"):
            return retry_disconnect(lambda: self._fetch_pinned(after, limit), self._drop_pinned)

    def _fetch_pinned(self, after: Position | None, limit: int) -> Page:
        pinned: sa.Connection | None = self._local.conn
        if pinned is None:
            pinned = self._local.conn = self._engine.connect()
        try:
            page = self._fetch(pinned, after, limit)
        except BaseException:
            with suppress(sa.exc.SQLAlchemyError):  # the fetch's own error is the one to report
                pinned.rollback()
            raise
        # Each page its own transaction: a fresh snapshot, no held xmin (a no-op in autocommit;
        # an engine a test passes may run transactions).
        pinned.rollback()
        return page

    def _drop_pinned(self) -> None:
        """Forget this thread's pinned connection (it was dead): the next fetch checks out another."""
        conn, self._local.conn = self._local.conn, None
        if conn is not None:
            with suppress(sa.exc.SQLAlchemyError):
                conn.close()

    def _read(self, read: Callable[[sa.Connection], T]) -> T:
        """``read`` on a connection checked out for it, again on a new one if that one was dead."""

        def once() -> T:
            with self._engine.connect() as conn:
                return read(conn)

        return retry_disconnect(once)

    @contextmanager
    def pinned(self) -> Iterator[None]:
        """Fetches inside (in this thread) reuse one pooled connection instead of a checkout each.

        A checkout and a check-in cost nothing on the server with the read engine (no pre-ping,
        autocommit: :mod:`poller.sources.engines`), but a page would still pay the pool's bookkeeping.
        The connection is checked out by the first fetch (whose errors stay fetch errors) and
        returned at the end; a dead one is replaced once (:func:`~poller.sources.engines.retry_disconnect`).
        """
        self._local.pinning, self._local.conn = True, None
        try:
            yield
        finally:
            conn, self._local.pinning, self._local.conn = self._local.conn, False, None
            if conn is not None:
                with suppress(sa.exc.SQLAlchemyError):
                    conn.close()

    def _fetch(self, conn: sa.Connection, after: Position | None, limit: int) -> Page:
        for attempt in range(REPLANS_PER_FETCH + 1):
            resolved = self._resolve(conn)
            try:
                plan = self._plan or self._make_plan(conn, resolved)
                fetched = self._rows(conn, resolved, plan, after, limit) if plan is not None else ([], _no_row, None)
                break
            except _ShapeChanged as changed:
                cause: sa.exc.DBAPIError | _ShapeChanged = changed
            except sa.exc.DBAPIError as exc:  # a column the statement names may be gone
                if resolved.shape is None or is_transient(exc):
                    raise
                if attempt:
                    raise self._still_failing(exc) from exc
                cause = exc
            conn.rollback()  # end the failed statement's transaction before reading the catalog
            self._replan(conn, resolved, cause)
        else:
            raise FetchError(
                f"poller {self._config.name}: the columns of {self._config.table!r} kept changing while it was "
                f"read ({REPLANS_PER_FETCH} re-plans); the next tick reads it again"
            )
        tuples, make_row, columns = fetched
        self._check_nulls(conn, resolved, short=len(tuples) < limit)
        return Page(tuples=tuples, make_row=make_row, columns=columns, skipped_null_cursors=self._null_count)

    def _replan(self, conn: sa.Connection, before: _Resolved, cause: sa.exc.DBAPIError | _ShapeChanged) -> None:
        """Reflect the table again after ``cause``; the next read is planned for its new shape.

        Raises the statement's own error when the table did not change (bad SQL in ``filter``),
        and SchemaChangeError when the cursor or a key column is gone or changed its type family.
        """
        assert before.shape is not None
        self._resolved = None
        try:
            now = self._resolve(conn, changed=True)
        except BaseException:
            self._resolved = before
            raise
        assert now.shape is not None
        if now.shape.same_as(before.shape):
            if isinstance(cause, sa.exc.DBAPIError):
                self._resolved = before
                raise cause
            if cause.by_value:
                raise CursorError(
                    f"cursor column {self._config.cursor!r} (poller {self._config.name}) holds {cause.value!r} "
                    f"among {self._kind.kind if self._kind else 'other'} values; they cannot be ordered together",
                    hint="keep one type in the cursor column (SQLite stores what it is given)",
                )
        else:
            try:
                self._check_key_types(before.shape, now.shape)
            except SchemaChangeError:
                self._resolved = before  # every tick says so again, until the operator decides (or reverts)
                raise
            log.info(
                "poller %s: table %s changed (%s); re-planned, reading on",
                self._config.name, self._config.table, now.shape.changes_since(before.shape),
                extra=ids(poller=self._config.name),
            )  # fmt: skip
        self._plan = None

    def _check_key_types(self, before: TableShape, now: TableShape) -> None:
        """A cursor or key column may widen (int -> bigint), never change its family (int -> text)."""
        old, new = before.types(), now.types()
        for key, name in self._needed()[: 1 + len(self._config.pk)]:
            if type_family(old[name]) != type_family(new[name]):
                change = f"changed the type ({old[name]!r} -> {new[name]!r}) of"
                raise key_change(self._config.name, str(self._config.table), _ROLES[key], name, change)

    def _still_failing(self, exc: sa.exc.DBAPIError) -> SchemaChangeError:
        return SchemaChangeError(
            f"poller {self._config.name}: table {self._config.table!r} changed and its read still fails "
            f"({driver_message(exc, self._config.source_url)}): the filter may name a column a migration renamed "
            f"or dropped (runbook: {RUNBOOK})",
            hint="update filter in dbfanout.toml to the table's new columns",
        )

    def acknowledge(self, checkpoint: Checkpoint) -> None:
        """Nothing to do: a table or query keeps no log to trim."""

    def close(self) -> None:
        """Nothing to release: the engine is shared per URL (see :func:`poller.sources.engines.dispose_engines`)."""

    # ------------------------------------------------------------------------------ introspection

    def index_warning(self) -> str | None:
        """Why fetches cannot seek an index (table mode, once resolved), or None."""
        return self._index_warning

    def keyset_query(self, after: Position | None, limit: int) -> tuple[sa.Select[Any], dict[str, Any]] | None:
        """The SELECT and parameters ``fetch`` runs (EXPLAIN tests, raw-scan benchmarks); None if empty."""
        with self._db_errors("plan"):
            return self._read(lambda conn: self._planned(conn, after, limit))

    def pending_rows(self, after: Position | None, limit: int) -> int:
        """Rows a fetch after ``after`` would return (settle window and filter included), counted up
        to ``limit``: one ``count(*)`` over the same keyset read, bounded so a deep backlog stays cheap."""

        def count(conn: sa.Connection) -> int:
            planned = self._planned(conn, after, limit)
            if planned is None:
                return 0
            select, params = planned
            return int(conn.execute(sa.select(sa.func.count()).select_from(select.subquery()), params).scalar_one())

        with self._db_errors("fetch"):
            return self._read(count)

    def _planned(
        self, conn: sa.Connection, after: Position | None, limit: int
    ) -> tuple[sa.Select[Any], dict[str, Any]] | None:
        plan = self._plan or self._make_plan(conn, self._resolve(conn))
        if plan is None:
            return None
        if after is None:
            return plan.first, {"dbf_limit": limit}
        return plan.after, {"dbf_limit": limit, **self._bind(plan.kind, after)}

    def describe(self) -> dict[str, Any]:
        """What the source resolved to, for ``dbfanout validate`` (connects on first use)."""

        def plan_of(conn: sa.Connection) -> _Plan | None:
            return self._plan or self._make_plan(conn, self._resolve(conn))

        with self._db_errors("describe"):
            plan = self._read(plan_of)
        cfg = self._config
        return {
            "poller": cfg.name,
            "url": self._url,
            "dialect": self._dialect,
            "mode": "table" if cfg.table else "query",
            "source": cfg.table or cfg.query,
            "cursor": cfg.cursor,
            "pk": list(cfg.pk),
            "cursor_kind": plan.kind.kind if plan else None,
            "predicate": predicate_style(self._dialect),
            "settle": self._settle_text(plan.kind if plan else None),
            "xid_horizon": cfg.xid_column,
            "null_cursor": cfg.null_cursor,
            "index_warning": self._index_warning,
            "fingerprint": self._fingerprint,
        }

    # ------------------------------------------------------------------------------ resolving

    def _resolve(self, conn: sa.Connection, *, changed: bool = False) -> _Resolved:
        """The source as reflected (once; again after a migration: ``changed``)."""
        if self._resolved is None:
            self._resolved = self._resolve_table(conn, changed) if self._config.table else self._resolve_query(conn)
        return self._resolved

    def _needed(self) -> list[tuple[str, str]]:
        cfg = self._config
        needed = [("cursor", cfg.cursor)] + [("pk", c) for c in cfg.pk]
        needed += [(k, v) for k, v in (("soft_delete_column", cfg.soft_delete_column),
                                       ("xid_column", cfg.xid_column)) if v]  # fmt: skip
        return needed

    def _check_columns(self, present: list[str], where: str, *, changed: bool = False) -> None:
        """Each needed column is in ``present``: else a ConfigError, or SchemaChangeError when ``changed``
        (a migration renamed or dropped it under a running poller)."""
        for key, name in self._needed():
            if name in present:
                continue
            if changed:
                raise key_change(self._config.name, str(self._config.table), _ROLES[key], name, "renamed or dropped")
            near = [p for p in present if p.lower() == name.lower()]
            hint = f"did you mean {near[0]!r}? (names are case-sensitive)" if near else None
            migrated = f"; if a migration renamed or dropped it: {RUNBOOK}" if self._config.table else ""
            raise ConfigError(
                f"{self._key}.{key}",
                f"column {name!r} is not in {where} (it has: {', '.join(present)}){migrated}",
                hint=hint,
            )

    def _resolve_table(self, conn: sa.Connection, changed: bool = False) -> _Resolved:
        assert self._config.table is not None
        schema, _, name = self._config.table.rpartition(".")
        try:
            with warnings.catch_warnings():  # unknown types (xid8, ...) reflect as NullType: values pass raw
                warnings.filterwarnings("ignore", "Did not recognize type", sa.exc.SAWarning)
                table = sa.Table(name, sa.MetaData(), schema=schema or None, autoload_with=conn)
        except sa.exc.NoSuchTableError:
            raise ConfigError(
                f"{self._key}.table", f"table {self._config.table!r} does not exist in {self._url}"
            ) from None
        self._check_columns([c.name for c in table.columns], f"table {self._config.table!r}", changed=changed)
        self._index_warning = index_gap(conn, table, list(dict.fromkeys([self._config.cursor, *self._config.pk])))
        if self._index_warning:
            log.warning(self._index_warning, extra=ids(poller=self._config.name))
        column = table.c[self._config.cursor]
        sqlite = self._dialect == "sqlite"
        # On SQLite the cursor is compared, ordered and checkpointed as the raw stored value.
        cursor = sa.type_coerce(column, sa.String()) if sqlite else column
        return _Resolved(
            from_=table,
            cursor=cursor,
            pk=tuple(table.c[p] for p in self._config.pk),
            columns=(sa.literal_column("*"),),  # the table's columns at each read: a migration shows at once
            raw_extra=sqlite,
            sqlite_declared=sqlite_declared_kind(column.type) if sqlite else None,
            filter=self._filter(),
            shape=TableShape.of(table),
        )

    def _resolve_query(self, conn: sa.Connection) -> _Resolved:
        assert self._config.query is not None
        names = [n for _, n in self._needed()]
        sub = sa.text(self._config.query).columns(*(sa.column(n) for n in dict.fromkeys(names))).subquery(_SUBQUERY)
        probe: sa.Select[Any] = sa.select(sa.literal_column("*")).select_from(sub).limit(0)
        present = list(conn.execute(probe).keys())
        self._check_columns(present, "the query's output")
        return _Resolved(
            from_=sub,
            cursor=sub.c[self._config.cursor],
            pk=tuple(sub.c[p] for p in self._config.pk),
            columns=(sa.literal_column("*"),),
            raw_extra=False,
            sqlite_declared=None,
            filter=self._filter(),
            shape=None,
        )

    def _filter(self) -> sa.ColumnElement[bool] | None:
        return sa.text(f"({self._config.filter})") if self._config.filter else None  # type: ignore[return-value]

    # ------------------------------------------------------------------------------ planning

    def _make_plan(self, conn: sa.Connection, r: _Resolved) -> _Plan | None:
        sample = conn.execute(self._probe_of(r)).scalar()
        if sample is None:
            return None  # no cursor values yet: nothing to order
        kind = classify(sample, self._config.cursor, sqlite_declared=r.sqlite_declared, tz=self._tz)
        if self._kind is not None and kind.kind != self._kind.kind:
            change = f"changed the values ({self._kind.kind} -> {kind.kind}) of"
            where = str(self._config.table or "query")
            raise key_change(self._config.name, where, "cursor", self._config.cursor, change)
        self._kind = kind
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
            columns = (*columns, r.cursor.label(_RAW_CURSOR))
            unprocessed = cfg.cursor if kind.kind in ("text_datetime", "text_date") else None
        select = sa.select(*columns).select_from(r.from_).order_by(*keys).limit(sa.bindparam("dbf_limit"))
        self._plan = _Plan(
            kind=kind,
            first=select.where(r.cursor.is_not(None), *base),
            after=select.where(seek, *base),
            family=value_family(sample),
            unprocessed=unprocessed,
        )
        return self._plan

    def _probe_of(self, r: _Resolved) -> sa.Select[Any]:
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
                f"{self._key}.cursor_timezone",
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

    def _settle_text(self, kind: CursorKind | None) -> str:
        cfg = self._config
        if cfg.settle_seconds <= 0:
            return "disabled (settle_seconds = 0)"
        if kind is None:
            return "unknown until the cursor column has a value"
        if not kind.temporal:
            return f"none: a {kind.kind} cursor has no time (single writer or xid_column needed)"
        return f"cursor older than {cfg.settle_seconds:g} s on the {self._dialect} clock"

    # ------------------------------------------------------------------------------ fetching

    def _rows(
        self, conn: sa.Connection, r: _Resolved, plan: _Plan, after: Position | None, limit: int
    ) -> tuple[Sequence[Any], Callable[[Any], SourceRow], KeysetColumns | None]:
        """Run the page's SELECT; return its tuples, the builder of one :class:`SourceRow` and their columns.

        Rows are built lazily (see :class:`~poller.ports.Page`): catching up costs one query and
        one ``fetchall`` per page, plus the last row's position.
        """
        cfg = self._config
        if after is None:
            result = conn.execute(plan.first, {"dbf_limit": limit})
        else:
            result = conn.execute(plan.after, {"dbf_limit": limit, **self._bind(plan.kind, after)})
        keys = list(result.keys())
        processors = self._result_shape(result, r, plan).processors if r.shape is not None else None
        tuples = fetch_tuples(result, processors)  # one fetchall: per-row fetchone costs as much as the query
        raw_extra = r.raw_extra
        if tuples and r.shape is not None:  # SQLite describes no types: a retyped cursor shows in its values
            raw = tuples[-1][keys.index(_RAW_CURSOR if raw_extra else cfg.cursor)]
            if raw is not None and value_family(raw) != plan.family:
                raise _ShapeChanged(raw, by_value=True)
        # The event carries the typed value; the position keeps what the database compares.
        convert = plan.kind.converter(cfg.cursor) if plan.kind.kind in ("naive", "text_datetime", "text_date") else None
        columns = KeysetColumns(
            tuple(keys), cfg.cursor, cfg.pk, _RAW_CURSOR if raw_extra else None, convert, cfg.soft_delete_column
        )
        if plan.kind.kind == "text_datetime" and tuples:
            at = keys.index(_RAW_CURSOR if raw_extra else cfg.cursor)
            self._check_text_format((tuples[0][at], tuples[len(tuples) // 2][at], tuples[-1][at]), plan.kind.sep)
        return tuples, columns.row_builder(), columns

    def _result_shape(self, result: sa.CursorResult[Any], r: _Resolved, plan: _Plan) -> ResultShape:
        """The processors of a table page's result; _ShapeChanged when its columns are not the plan's."""
        assert r.shape is not None
        description = result.cursor.description
        if plan.result is None:  # the plan's first read: the result must have the reflected columns
            plan.result = ResultShape.accept(
                description,
                r.shape.types(),
                self._engine.dialect,
                extra=_RAW_CURSOR if r.raw_extra else None,
                unprocessed=plan.unprocessed,
            )
        if plan.result is None or description_signature(description) != plan.result.signature:
            result.close()
            raise _ShapeChanged
        return plan.result

    def _check_text_format(self, raws: Iterable[Any], sep: str) -> None:
        """Sampled (first, middle, last of each page): a mixed format shows up within a few pages."""
        for raw in raws:
            if isinstance(raw, str) and len(raw) > 10 and raw[10] != sep:
                self._warn_mixed_format(raw, sep)
                return

    def _bind(self, kind: CursorKind, after: Position) -> dict[str, Any]:
        missing = [p for p in self._config.pk if p not in after.pk]
        if missing:
            raise CursorError(
                f"the checkpoint's tiebreaker has {sorted(after.pk)} but pk is {list(self._config.pk)}",
                hint="the pk setting changed under a checkpoint: reset the checkpoint or restore the old pk",
            )
        params = {"k0": kind.rebind(after.cursor)}
        params.update({f"k{i}": after.pk[p] for i, p in enumerate(self._config.pk, start=1)})
        return params

    def _check_nulls(self, conn: sa.Connection, r: _Resolved, *, short: bool) -> None:
        now = time.monotonic()
        due = self._null_checked_at is None or (short and now - self._null_checked_at >= self.NULL_CHECK_SECONDS)
        if not due:
            return
        query = sa.select(sa.func.count()).select_from(r.from_).where(r.cursor.is_(None))
        if r.filter is not None:
            query = query.where(r.filter)
        self._null_count = int(conn.execute(query).scalar() or 0)
        self._null_checked_at = now
        if self._null_count and self._config.null_cursor == "fail":
            raise CursorError(
                f"{self._null_count} row(s) have a NULL in cursor column {self._config.cursor!r} (poller "
                f"{self._config.name}); they cannot be ordered against the checkpoint",
                hint=f"fill {self._config.cursor} (e.g. a NOT NULL DEFAULT now()), exclude the rows with filter, "
                'or set null_cursor = "skip" to deliver the rest',
            )
        if self._null_count:
            log.warning(
                "poller %s: %d row(s) with a NULL %s are invisible to it (null_cursor = skip)",
                self._config.name, self._null_count, self._config.cursor,
                extra=ids(poller=self._config.name, skipped_null_cursors=self._null_count),
            )  # fmt: skip

    # ------------------------------------------------------------------------------ errors & logs

    def _warn_once(self, key: str, message: str, *args: Any) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning("poller %s: " + message, self._config.name, *args, extra=ids(poller=self._config.name))

    def _warn_mixed_format(self, raw: str, sep: str) -> None:
        self._warn_once("format", "cursor %r mixes text formats (%r does not use %r as the date/time separator); "
                        "SQLite orders the text, so keep one format", self._config.cursor, raw, sep)  # fmt: skip

    def _db_errors(self, op: str) -> AbstractContextManager[None]:
        return db_errors(f"poller {self._config.name}: {op} from {self._url}", self._config.source_url)


def _no_row(tup: Any) -> SourceRow:
    raise AssertionError("an empty page has no rows")


def _zone(name: str | None, key: str) -> ZoneInfo | None:
    if not name:
        return None
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError) as exc:
        raise ConfigError(key, f"unknown time zone {name!r}", hint='use an IANA name such as "UTC"') from exc

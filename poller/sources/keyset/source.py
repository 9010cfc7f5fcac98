"""The SQLAlchemy keyset source: a table or a query, read in ``(cursor, pk...)`` order.

``SqlSource(config).fetch(after, limit)`` returns the rows strictly after ``after``, oldest first,
that the database considers settled. Everything is evaluated by the database: the order, the seek
predicate (:mod:`poller.sources.keyset.plan`), the settle window and the xid horizon
(:mod:`poller.sources.keyset.late_commits`).

Lifecycle: the constructor only checks the configuration (no connection). The first ``fetch``
resolves the source (reflects the table, or checks the query's output columns:
:mod:`poller.sources.keyset.resolve`), finds the cursor's kind from its first non-NULL value, and
builds the two SELECTs (first page; page after a position) once, with bind parameters
(:mod:`poller.sources.keyset.statements`); each page runs one of them
(:mod:`poller.sources.keyset.pages`). A table with no cursor values yet returns empty pages until it
has one. This module is the port over them: connections, migrations (re-plans), NULL cursors, errors.

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
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, suppress
from typing import Any, TypeVar
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import sqlalchemy as sa

from poller.ports import Page, SourceRow
from poller.sources.engines import db_errors, driver_message, is_transient, retry_disconnect, source_engine
from poller.sources.keyset.pages import ShapeChanged, bind, read_page
from poller.sources.keyset.plan import predicate_style
from poller.sources.keyset.resolve import ROLES, Resolved, needed, resolve
from poller.sources.keyset.statements import Plan, Planner
from poller.sources.keyset.table_shape import RUNBOOK, TableShape, key_change, type_family
from shared.config import PollerConfig
from shared.errors import ConfigError, CursorError, FetchError, SchemaChangeError
from shared.ids import source_fingerprint
from shared.logs import get_logger, ids
from shared.models import Checkpoint, Position
from shared.settings import fingerprint_url, redact_url

__all__ = ["SqlSource"]

log = get_logger("poller.source")
T = TypeVar("T")

#: Re-plans one fetch may make when the table changes under it (each after a re-reflection).
REPLANS_PER_FETCH = 3


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
        self._resolved: Resolved | None = None
        self._plan: Plan | None = None
        self._planner = Planner(config, self._dialect, self._tz, self._warn_once)
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
                fetched = (
                    read_page(conn, self._config, resolved, plan, after, limit, self._warn_once)
                    if plan is not None
                    else ([], _no_row, None)
                )
                break
            except ShapeChanged as changed:
                cause: sa.exc.DBAPIError | ShapeChanged = changed
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

    def _replan(self, conn: sa.Connection, before: Resolved, cause: sa.exc.DBAPIError | ShapeChanged) -> None:
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
                kind = self._planner.kind
                raise CursorError(
                    f"cursor column {self._config.cursor!r} (poller {self._config.name}) holds {cause.value!r} "
                    f"among {kind.kind if kind else 'other'} values; they cannot be ordered together",
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
        for key, name in needed(self._config)[: 1 + len(self._config.pk)]:
            if type_family(old[name]) != type_family(new[name]):
                change = f"changed the type ({old[name]!r} -> {new[name]!r}) of"
                raise key_change(self._config.name, str(self._config.table), ROLES[key], name, change)

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
        return plan.after, {"dbf_limit": limit, **bind(self._config, plan.kind, after)}

    def describe(self) -> dict[str, Any]:
        """What the source resolved to, for ``dbfanout validate`` (connects on first use)."""

        def plan_of(conn: sa.Connection) -> Plan | None:
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
            "settle": self._planner.settle_text(plan.kind if plan else None),
            "xid_horizon": cfg.xid_column,
            "null_cursor": cfg.null_cursor,
            "index_warning": self._index_warning,
            "fingerprint": self._fingerprint,
        }

    # ------------------------------------------------------------------------------ resolving & planning

    def _resolve(self, conn: sa.Connection, *, changed: bool = False) -> Resolved:
        """The source as reflected (once; again after a migration: ``changed``)."""
        if self._resolved is None:
            self._resolved = resolve(conn, self._config, changed=changed)
            if self._config.table:
                self._index_warning = self._resolved.index_warning
        return self._resolved

    def _make_plan(self, conn: sa.Connection, r: Resolved) -> Plan | None:
        self._plan = self._planner.plan(conn, r)
        return self._plan

    # ------------------------------------------------------------------------------ fetching

    def _check_nulls(self, conn: sa.Connection, r: Resolved, *, short: bool) -> None:
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

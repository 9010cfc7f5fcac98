"""The outbox source (``kind = "outbox"``): the changes an application wrote, one event per row.

The application writes one row per change into the outbox table in the same transaction as its
business write (:mod:`shared.outbox`); this source reads the table in commit order, so hard
deletes and every intermediate update arrive, in order. It is a keyset read of the outbox
(a :class:`~poller.sources.keyset.source.SqlSource` underneath: same pinning, errors, and checkpoint format) in
an order that no late commit can break:

* **PostgreSQL**: ``(txid, id)`` with the transaction-id horizon
  ``txid < pg_snapshot_xmin(pg_current_snapshot())``: a row is read only once every transaction
  that could still commit before it has ended. Exact, no settle window. Rows of one transaction
  are contiguous and in write order; transactions come in transaction-id order.
* **MariaDB / MySQL, SQLite**: ``id`` order, read only up to the first row still inside the settle
  window (``created_at`` newer than the database's now minus ``settle_seconds``): the settled
  *prefix*, so a row is never read past an unsettled one. Safe while no writing transaction
  stays open longer than the window after its outbox insert. (SQLite has one writer at a time:
  ids are handed out in commit order anyway.)

Migrations: an event's ``after`` is the payload the application wrote, so a migration of the
application's tables shows in events exactly as the application writes it. The outbox table
itself may gain columns (the keyset read underneath follows the table); a migration that renames
or drops one of its own columns (:data:`shared.outbox.COLUMNS`) is caught on the first page read
after it: a ConfigError naming the column, before any row of that page is delivered.

Pruning (``outbox_retention_seconds``): :meth:`OutboxSource.acknowledge`, called after a tick's
last checkpoint write landed, deletes rows that checkpoint covers and that are older than the
retention, at most one tick's worth of rows per call, and never the newest row (an
auto-increment counter must not go back, on any server version).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from zoneinfo import ZoneInfo

import orjson
import sqlalchemy as sa

from poller.ports import EventFields, Page, SourceRow
from poller.sources.engines import db_errors, source_engine
from poller.sources.keyset.late_commits import settle_predicate
from poller.sources.keyset.plan import CursorKind
from poller.sources.keyset.source import SqlSource
from shared.config import PollerConfig
from shared.errors import ConfigError, SourceError
from shared.ids import source_fingerprint
from shared.logs import get_logger, ids
from shared.models import Checkpoint, Position
from shared.outbox import COLUMNS, is_delete, outbox_ddl
from shared.settings import fingerprint_url, redact_url

__all__ = ["OutboxSource"]

log = get_logger("poller.outbox")

_MAX_ID = 2**63 - 1
#: One prune deletes at most a tick's worth of rows (batch_size x max_batches_per_tick), or this many.
PRUNE_MIN_ROWS = 1000
_UTC = ZoneInfo("UTC")
# How created_at is stored (see shared.outbox.outbox_ddl), for the settle and retention bounds.
_CREATED_KIND = {
    "postgresql": CursorKind("aware"),
    "mysql": CursorKind("naive", _UTC),
    "mariadb": CursorKind("naive", _UTC),
    "sqlite": CursorKind("text_datetime", _UTC, " "),
}


def _created_time(value: Any) -> dt.datetime | None:
    """An outbox row's ``created_at`` as an aware UTC time (stored naive UTC or as text on some
    databases); None when it cannot be read (it only feeds commit -> handler latency)."""
    if isinstance(value, str):
        try:
            value = dt.datetime.fromisoformat(value)
        except ValueError:
            return None
    if not isinstance(value, dt.datetime):
        return None
    return value if value.tzinfo is not None else value.replace(tzinfo=dt.UTC)


class OutboxSource:
    """The :class:`~poller.ports.Source` port over an outbox table."""

    def __init__(self, config: PollerConfig, engine: sa.Engine | None = None) -> None:
        if config.kind != "outbox" or not config.table:
            raise ConfigError(f"pollers.{config.name}.kind", 'OutboxSource needs kind = "outbox" and a table')
        self._config = config
        self._engine = source_engine(config, engine)
        self._dialect = self._engine.dialect.name
        if self._dialect not in _CREATED_KIND:
            raise ConfigError(
                f"pollers.{config.name}.kind",
                f"the outbox source supports PostgreSQL, MariaDB/MySQL and SQLite (this source is {self._dialect})",
            )
        self._url = redact_url(config.source_url)
        self._horizon = self._dialect == "postgresql"
        self._fingerprint = source_fingerprint(
            {"kind": "outbox", "url": fingerprint_url(config.source_url), "table": config.table}
        )
        schema, _, name = config.table.rpartition(".")
        self._table = sa.table(
            name, *(sa.column(c) for c in (*COLUMNS, "txid")), schema=schema or None
        )  # lightweight: only for the statements we build
        self._inner: SqlSource | None = None
        self._needed = frozenset((*COLUMNS, "txid") if self._horizon else COLUMNS)

    # ------------------------------------------------------------------------------ the port

    @property
    def fingerprint(self) -> str:
        return self._fingerprint

    def fetch(self, after: Position | None, limit: int) -> Page:
        page = self._keyset().fetch(after, limit)
        if page.columns is not None and not self._needed.issubset(page.columns.keys):  # a migration took one
            with self._db_errors("resolve"), self._engine.connect() as conn:
                self._check_columns(conn)
        return page.mapped(self._to_change)

    def pending_rows(self, after: Position | None, limit: int) -> int:
        """Outbox rows not yet sent, counted up to ``limit`` (the same read as ``fetch``)."""
        return self._keyset().pending_rows(after, limit)

    @contextmanager
    def pinned(self) -> Iterator[None]:
        with self._keyset().pinned():
            yield

    def acknowledge(self, checkpoint: Checkpoint) -> None:
        """Prune what ``checkpoint`` (landed) covers, past the retention; no-op without retention."""
        retention = self._config.outbox_retention_seconds
        if retention is None or checkpoint.position is None:
            return
        with self._db_errors("prune"), self._engine.begin() as conn:
            deleted = conn.execute(self._prune_statement(checkpoint.position, retention)).rowcount
        if deleted:
            log.info("pruned %d outbox row(s) older than %gs", deleted, retention, extra=ids(poller=self._config.name))

    def close(self) -> None:
        """Nothing to release: the engine is shared per URL."""

    # ------------------------------------------------------------------------------ introspection

    def describe(self) -> dict[str, Any]:
        """What ``dbfanout validate`` shows (connects; checks the table's columns)."""
        keyset = self._keyset().describe()  # resolves the keyset read: its index check included
        with self._db_errors("describe"), self._engine.connect() as conn:
            index = self._index_gap(conn)
        cfg = self._config
        return {
            "poller": cfg.name,
            "url": self._url,
            "dialect": self._dialect,
            "mode": "outbox",
            "source": cfg.table,
            "cursor": "txid, id" if self._horizon else "id",
            "pk": ["aggregate"],
            "cursor_kind": "outbox",
            "predicate": "row-value" if self._horizon else "expanded",
            "settle": self._settle_text(),
            "xid_horizon": "txid" if self._horizon else None,
            "null_cursor": cfg.null_cursor,
            "index_warning": index or keyset["index_warning"],
            "retention": cfg.outbox_retention_seconds,
            "fingerprint": self._fingerprint,
        }

    def create_missing(self) -> list[str]:
        """``dbfanout validate --fix``: create the outbox table, or its index, when missing.

        Never at tick time: the table is the application's. Returns what was created.
        """
        schema, _, name = str(self._config.table).rpartition(".")
        table, index = outbox_ddl(self._dialect, str(self._config.table))
        created = index.split(" ON ")[0].removeprefix("CREATE ")
        with self._db_errors("create"), self._engine.begin() as conn:
            inspector = sa.inspect(conn)
            if not inspector.has_table(name, schema=schema or None):
                conn.exec_driver_sql(table)
                conn.exec_driver_sql(index)
                return [f"table {self._config.table}", created]
            if self._has_read_index(inspector):
                return []
            conn.exec_driver_sql(index)
            return [created]

    def _has_read_index(self, inspector: Any) -> bool:
        """An index leads with the read's columns: (txid, id) on PostgreSQL, created_at elsewhere."""
        schema, _, name = str(self._config.table).rpartition(".")
        wanted = ["txid", "id"] if self._horizon else ["created_at"]
        indexes = inspector.get_indexes(name, schema=schema or None)
        return any(list(ix["column_names"])[: len(wanted)] == wanted for ix in indexes)

    def index_warning(self) -> str | None:
        return self._keyset().index_warning()

    # ------------------------------------------------------------------------------ internals

    def _keyset(self) -> SqlSource:
        """The keyset read underneath, made on first use (it checks the table first)."""
        if self._inner is None:
            with self._db_errors("resolve"), self._engine.connect() as conn:
                self._check_columns(conn)
            cfg = self._config
            if self._horizon:
                keyset = dataclasses.replace(cfg, kind="keyset", cursor="txid", xid_column="txid", settle_seconds=0)
            else:
                # settle_seconds is in the filter (the settled prefix): none on the inner keyset read
                keyset = dataclasses.replace(
                    cfg, kind="keyset", cursor="id", filter=self._settled_prefix(), settle_seconds=0
                )
            self._inner = SqlSource(dataclasses.replace(keyset, outbox_retention_seconds=None), self._engine)
        return self._inner

    def _settled_prefix(self) -> str | None:
        """SQL: ``id`` below the first row still inside the settle window (None: no window)."""
        seconds = self._config.settle_seconds
        if seconds <= 0:
            return None
        recent = self._table.alias("dbf_unsettled")
        settled = settle_predicate(
            recent.c.created_at, self._dialect, _CREATED_KIND[self._dialect], seconds, self._config.name
        )
        assert settled is not None
        first_unsettled = sa.select(sa.func.min(recent.c.id)).where(sa.not_(settled)).scalar_subquery()
        bound = sa.column("id") < sa.func.coalesce(first_unsettled, _MAX_ID)
        return str(bound.compile(dialect=self._engine.dialect, compile_kwargs={"literal_binds": True}))

    def _to_change(self, row: SourceRow) -> SourceRow:
        values = row.values
        outbox_id, change = values["id"], values["type"]
        return SourceRow(
            position=row.position,
            values=_payload(values["payload"], outbox_id, self._config.table),
            deleted=is_delete(change),
            event=EventFields(
                pk={"aggregate": values["aggregate"]},
                cursor=outbox_id,
                change=change,
                table=self._config.table,
                committed_at=_created_time(values.get("created_at")),
            ),
        )

    def _prune_statement(self, position: Position, retention: float) -> sa.Delete:
        t = self._table
        old = settle_predicate(t.c.created_at, self._dialect, _CREATED_KIND[self._dialect], retention, "prune")
        if old is None:  # retention 0: as soon as a landed checkpoint covers them
            old = sa.true()
        newest = sa.select(sa.func.max(t.c.id)).scalar_subquery()
        if self._horizon:
            # The checkpoint keeps the xid8 as text (it has no SQLAlchemy type): cast it back.
            covered: sa.ColumnElement[bool] = sa.text(  # type: ignore[assignment]
                "(txid, id) <= (CAST(:dbf_txid AS xid8), :dbf_id)"
            ).bindparams(dbf_txid=str(position.cursor), dbf_id=position.pk["id"])
            order: tuple[Any, ...] = (t.c.txid, t.c.id)
        else:
            covered, order = t.c.id <= sa.literal(position.cursor), (t.c.id,)
        # The newest row stays (its id keeps the auto-increment counter up); at most a tick's worth.
        limit = max(PRUNE_MIN_ROWS, self._config.batch_size * self._config.max_batches_per_tick)
        victims = sa.select(t.c.id).where(covered, old, t.c.id < newest).order_by(*order).limit(limit)
        if self._dialect in ("mysql", "mariadb"):  # MariaDB cannot DELETE ... WHERE id IN (SELECT ... same table)
            victims = sa.select(victims.subquery("dbf_victims").c.id)
        return t.delete().where(t.c.id.in_(victims))

    def _check_columns(self, conn: sa.Connection) -> None:
        schema, _, name = str(self._config.table).rpartition(".")
        key = f"pollers.{self._config.name}.table"
        try:
            with warnings.catch_warnings():  # xid8 has no SQLAlchemy type: only its name matters here
                warnings.filterwarnings("ignore", "Did not recognize type", sa.exc.SAWarning)
                present = {c["name"] for c in sa.inspect(conn).get_columns(name, schema=schema or None)}
        except sa.exc.NoSuchTableError:
            raise ConfigError(
                key, f"outbox table {self._config.table!r} does not exist in {self._url}", hint=self._ddl_hint()
            ) from None
        missing = [c for c in (*COLUMNS, "txid") if c in self._needed and c not in present]
        if missing:
            raise ConfigError(
                key,
                f"outbox table {self._config.table!r} lacks column(s) {', '.join(missing)}",
                hint=self._ddl_hint(),
            )

    def _ddl_hint(self) -> str:
        ddl = ";\n".join(outbox_ddl(self._dialect, str(self._config.table)))
        return f"create it as (docs/outbox.md; or shared.outbox.create_outbox):\n{ddl};"

    def _index_gap(self, conn: sa.Connection) -> str | None:
        """The settle window's ``created_at`` index (the keyset's own index is checked underneath)."""
        if self._horizon or self._has_read_index(sa.inspect(conn)):
            return None
        name = str(self._config.table).rpartition(".")[2]
        return (
            f"no index on {self._config.table} starts with created_at: every page's settle check scans the table; "
            f"create one: CREATE INDEX ix_{name}_created ON {self._config.table} (created_at)"
        )

    def _settle_text(self) -> str:
        if self._horizon:
            return "none needed: the transaction-id horizon (txid) orders and guards the outbox"
        if self._config.settle_seconds <= 0:
            return "disabled (settle_seconds = 0): safe only with a single writer"
        return f"outbox rows older than {self._config.settle_seconds:g} s on the {self._dialect} clock (settled prefix)"

    def _db_errors(self, op: str) -> Any:
        return db_errors(f"poller {self._config.name}: {op} outbox {self._url}", self._config.source_url)


def _payload(raw: Any, outbox_id: Any, table: Any) -> dict[str, Any]:
    """The event's ``after``: the payload as a dict (``{}`` when the row has none)."""
    if raw is None:
        return {}
    if isinstance(raw, bytes | str):
        try:
            raw = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise SourceError(f"outbox {table} row {outbox_id}: payload is not JSON ({exc})") from exc
    if not isinstance(raw, dict):
        raise SourceError(
            f"outbox {table} row {outbox_id}: payload must be a JSON object or NULL, not {type(raw).__name__}",
            hint="write changes with shared.outbox.write_change, or wrap the value in an object",
        )
    return raw

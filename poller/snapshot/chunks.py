"""Snapshots beside the stream: DBLog's watermark algorithm, and PostgreSQL's chunk SQL.

The algorithm is run by :mod:`poller.snapshot.coordinator` for every change log (``pg_logical``,
``mysql_binlog``); this module holds what both share (:class:`Chunk`, the signal rows, requests,
the state) and PostgreSQL's :class:`ChunkReader` (MySQL's: :mod:`poller.snapshot.mysql`). What
follows describes it on PostgreSQL.

Why: a slot only has the changes made after it was created; the rows that already exist (and the
rows a lost slot skipped) must be read from the tables, without pausing the stream and without
ever letting a row read from the table overwrite a newer change of the same key.

How (Netflix's DBLog, as Debezium's incremental snapshots do it), one *chunk* at a time:

1. the window opens at the stream position ``P`` the chunk starts from (the low watermark: a
   position already in the log, so it needs no write of its own — see "the low watermark" below);
2. one statement selects the chunk by keyset on the primary key (``WHERE (pk) > (last key) ORDER
   BY pk LIMIT chunk_size``) and writes a *high watermark* row to our signal table, which is in the
   poller's publication; the transaction commits after the statement's snapshot, so the watermark
   appears in the log after every change the select could have seen;
3. while the log is read from ``P`` to the high watermark, every key the log changed is dropped
   from the chunk (the log delivers that key's newer state itself);
4. from the high watermark on, the rest of the chunk is emitted as ``change = "read"`` events, a
   page at a time, each at the log position read so far; the window stays open until the last row
   is out (a key changed before its row went leaves the chunk), and the snapshot's position (table,
   last key, counts) advances with each page's checkpoint.

A chunk row therefore reaches the handler at a log position after every change the select saw and
after every change of its key read so far, and before every later change: it can never overwrite a
newer change, and a key deleted meanwhile is not resurrected (its delete is in the window; the row
is dropped).

The low watermark. DBLog writes one before the select; the window then starts there. A
transaction whose commit record precedes that write but which is not yet *visible* when the select
takes its snapshot (PostgreSQL makes a commit visible a moment after writing it; with synchronous
replication, after the standby confirmed it) would fall before the window and its key would be
emitted with the older value. Here the window opens earlier, at ``P`` (where the stream stood
before the select), and the select refuses its snapshot when a transaction it cannot see is
already committed (it retries on the next fetch), which covers the synchronous-replication wait.

The snapshot's state is a :class:`~shared.models.SnapshotState` carried by every position the
source returns while it runs (:attr:`~shared.models.Position.snapshot`), so it lands in the state
blob with the checkpoint (same CAS, same fencing) and a crash or a lease handover resumes after the
last landed page. A chunk in flight lives in memory only: after a crash its rest is read again (its
rows keep their event ids: the id of a snapshot row is a function of the snapshot run — the
state's ``id``: the request's id, ``initial`` for the first — its table, key and row version —
its ``xmin`` — so duplicate detection absorbs the copies). Another run reads the same unchanged
row as a new event: a snapshot taken to repair a target delivers every row it reads, through
broker duplicate detection and ``ProcessedEvents`` alike.

Requests (``dbfanout snapshot``) are rows of the same signal table: they arrive through the log,
in order with the changes, and never race the poller's own state writes. A state change no row
carries (a request, a cancel, an empty last chunk) is checkpointed by itself (``Page.advance``).
"""

from __future__ import annotations

import datetime as dt
import operator
import uuid
from collections.abc import Callable, Mapping, Sequence
from contextlib import suppress
from dataclasses import dataclass, field, replace
from typing import Any

import sqlalchemy as sa

from poller.snapshot.values import postgres_rows
from poller.snapshot.where import WhereRefused, where_sql
from poller.sources.keyset.source import fetch_tuples
from shared.codec import dumps, loads
from shared.config import PollerConfig
from shared.errors import SourceError
from shared.models import SnapshotState

__all__ = [
    "Chunk",
    "ChunkReader",
    "apply_request",
    "chunk_size",
    "initial_state",
    "qualified",
    "quote_table",
    "request_params",
    "request_statement",
    "signal_sql",
]

KIND_WATERMARK = "watermark"
KIND_REQUEST = "request"
XMIN = "dbfanout_xmin__"  # the row version, selected beside the row's columns

_PRIMARY_KEY = sa.text(
    "SELECT a.attname FROM pg_index i CROSS JOIN LATERAL unnest(i.indkey) WITH ORDINALITY AS k(attnum, n)"
    " JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum"
    " WHERE i.indrelid = to_regclass(:table) AND i.indisprimary ORDER BY k.n"
)
_COLUMNS = sa.text(
    "SELECT attname FROM pg_attribute WHERE attrelid = to_regclass(:table) AND attnum > 0 AND NOT attisdropped"
)
# The planner's row count; for a table never analysed (reltuples -1), the statistics' live rows.
_ESTIMATE = sa.text(
    "SELECT CAST(CASE WHEN c.reltuples >= 0 THEN c.reltuples ELSE COALESCE(s.n_live_tup, 0) END AS bigint)"
    " FROM pg_class c LEFT JOIN pg_stat_user_tables s ON s.relid = c.oid WHERE c.oid = to_regclass(:table)"
)
# A chunk, in one statement (one snapshot): its rows in key order, each with its version (its
# xmin) and the racy flag; and its high watermark, written when it has rows and is not racy. Racy:
# a transaction the snapshot cannot see is already committed, so its commit may precede the window
# (see the module docstring); the rows are refused then. An empty chunk cannot be stale: the flag
# does not matter when no row comes. (A scalar subquery, not EXISTS: the planner drops the ORDER
# BY and LIMIT of an EXISTS and may scan the table from its start.) txid_* exist from PostgreSQL
# 10 on.
_CHUNK = (
    "WITH dbfanout_racy__ AS (SELECT EXISTS (SELECT 1 FROM txid_snapshot_xip(txid_current_snapshot()) AS x(xid)"
    "  WHERE txid_status(x.xid) = 'committed') AS racy),"
    " dbfanout_mark__ AS (INSERT INTO {signal} (poller, kind, id, data, written_at)"
    "  SELECT :poller, '" + KIND_WATERMARK + "', :id, '{{}}', now()"
    "  WHERE NOT (SELECT racy FROM dbfanout_racy__)"
    "  AND (SELECT 1 FROM {table} WHERE {where} ORDER BY {cols} LIMIT 1) IS NOT NULL"
    "  ON CONFLICT (poller, kind) DO UPDATE SET id = EXCLUDED.id, data = EXCLUDED.data,"
    "  written_at = EXCLUDED.written_at)"
    " SELECT *, CAST(xmin AS text) AS " + XMIN + ", (SELECT racy FROM dbfanout_racy__) AS dbfanout_racy__"
    " FROM {table} WHERE {where} ORDER BY {cols} LIMIT :n"
)
_PUBLISHED = sa.text(
    "SELECT 1 FROM pg_publication_tables WHERE pubname = :pub AND schemaname || '.' || tablename = :table"
)


def within(start: Any, scanned_to: Any, position: Any) -> bool:
    """Whether ``position`` lies in ``[start, scanned_to]`` (``scanned_to`` None: ``start``), over
    opaque ordered position keys where None is before the whole log."""
    if position is None:
        return start is None
    high = start if scanned_to is None else scanned_to
    return (start is None or start <= position) and high is not None and position <= high


def qualified(table: str) -> str:
    """``orders`` → ``public.orders`` (how the log names a table)."""
    return table if "." in table else f"public.{table}"


def quote_table(name: str) -> str:
    return ".".join('"' + part.replace('"', '""') + '"' for part in name.split("."))


def signal_sql(config: PollerConfig) -> list[str]:
    """The signal table (shared by the pollers of a database; each reads its own rows)."""
    table = quote_table(config.signal_table)
    return [
        f"CREATE TABLE IF NOT EXISTS {table} ("
        " poller text NOT NULL, kind text NOT NULL, id text NOT NULL, data text NOT NULL DEFAULT '{}',"
        " written_at timestamptz NOT NULL DEFAULT now(), PRIMARY KEY (poller, kind))"
    ]


_UPSERT = (
    "INSERT INTO {table} (poller, kind, id, data, written_at) VALUES (:poller, :kind, :id, :data, now())"
    " ON CONFLICT (poller, kind) DO UPDATE SET id = EXCLUDED.id, data = EXCLUDED.data,"
    " written_at = EXCLUDED.written_at"
)


def request_statement(
    config: PollerConfig,
    *,
    tables: Sequence[str] | None = None,
    where: str | None = None,
    chunk_size: int | None = None,
    cancel: bool = False,
) -> tuple[sa.TextClause, dict[str, Any]]:
    """The statement (and its parameters) that asks a running poller for a snapshot, or cancels it.

    One row per poller (a new request replaces one not yet started); the poller reads it from its
    slot, in order with the changes.
    """
    params = request_params(config, tables=tables, where=where, chunk_size=chunk_size, cancel=cancel)
    return sa.text(_UPSERT.format(table=quote_table(config.signal_table))), params


def request_params(
    config: PollerConfig,
    *,
    tables: Sequence[str] | None = None,
    where: str | None = None,
    chunk_size: int | None = None,
    cancel: bool = False,
) -> dict[str, Any]:
    """A request row's values (a new id each time), whatever the database's upsert looks like."""
    data: dict[str, Any] = {"action": "cancel"} if cancel else {
        "action": "snapshot",
        "tables": list(tables) if tables else None,
        "where": where,
        "chunk_size": chunk_size,
    }  # fmt: skip
    return {"poller": config.name, "kind": KIND_REQUEST, "id": uuid.uuid4().hex, "data": dumps(data).decode()}


#: The default chunk: this many pages (``batch_size`` rows each), at most CHUNK_MAX_ROWS rows (at
#: least one page). A chunk costs a select, a watermark and a peek of the slot whatever its size;
#: its pages then come out of memory (with a peek before each only when the log grew meanwhile).
CHUNK_PAGES = 4
CHUNK_MAX_ROWS = 20_000


def chunk_size(config: PollerConfig, requested: Any = None) -> int:
    """Rows a chunk reads: the request's, else ``snapshot_chunk_size``, else :data:`CHUNK_PAGES` pages."""
    if isinstance(requested, int) and not isinstance(requested, bool) and requested > 0:
        return requested
    if config.snapshot_chunk_size:
        return config.snapshot_chunk_size
    return max(config.batch_size, min(CHUNK_PAGES * config.batch_size, CHUNK_MAX_ROWS))


def initial_state(
    config: PollerConfig, now: dt.datetime, estimate: int | None, *, qualify: Callable[[str], str] = qualified
) -> SnapshotState:
    """``snapshot = "initial"``: every table of the poller, from its start (``qualify``: how the
    log names a table; PostgreSQL's ``public.`` by default)."""
    return SnapshotState(
        id="initial",
        tables=tuple(qualify(t) for t in config.tables),
        chunk_size=chunk_size(config),
        estimate=estimate,
        started_at=now,
    )


def apply_request(
    config: PollerConfig,
    state: SnapshotState | None,
    data: Mapping[str, Any],
    request_id: str,
    at: dt.datetime,
    *,
    qualify: Callable[[str], str] = qualified,
) -> tuple[SnapshotState | None, str | None]:
    """The state after a request row read from the log, and a warning when it was refused
    (``qualify``: how the log names a table)."""
    action = data.get("action")
    if action == "cancel":
        if state is None or not state.active:
            return state, None
        return replace(state, tables=(), last_key=None, finished_at=at, cancelled=True), None
    if action != "snapshot":
        return state, f"request {request_id}: unknown action {action!r} ignored"
    known = [qualify(t) for t in config.tables]
    asked = data.get("tables") or known
    tables = [qualify(str(t)) for t in asked]
    unknown = [t for t in tables if t not in known]
    if unknown:
        return state, f"request {request_id}: {', '.join(unknown)} not among the poller's tables; ignored"
    where = data.get("where")
    return SnapshotState(
        id=request_id,
        tables=tuple(tables),
        chunk_size=chunk_size(config, data.get("chunk_size")),
        where=where if isinstance(where, str) and where.strip() else None,
        started_at=at,
    ), None


@dataclass(eq=False)
class Chunk:
    """One chunk read from a table: it waits for its high watermark in the log, then its rows are
    emitted, a page at a time, while its window stays open (a key the log changes before its row
    is emitted still leaves the chunk)."""

    id: str
    state: SnapshotState  # the snapshot's state it is valid for (it moves as its rows are emitted)
    table: str
    pk: tuple[str, ...]
    names: tuple[str, ...]  # the row's columns: each tuple holds them, then its version (PostgreSQL: xmin), a flag
    start: Any  # P: the stream position key the window opens at (opaque, ordered; None: before the log)
    tuples: Sequence[Any]  # the selected rows, in key order
    key_of: Callable[[Any], Any]  # a tuple's key: the value of a one-column key, else a tuple
    last_key: dict[str, Any] | None  # the last key selected (dropped or not): the next chunk starts after it
    more: bool  # the table has rows after it
    scanned_to: Any = None  # the log read so far by this chunk's window (a position key)
    ready_at: dt.datetime | None = None  # when its high watermark committed (read from the log): rows may go
    keys: set[Any] = field(default_factory=set)  # every selected key
    dropped: set[Any] = field(default_factory=set)  # the keys the log changed inside the window
    taken: int = 0  # tuples handled so far (emitted or dropped)

    def __post_init__(self) -> None:
        self.keys = set(map(self.key_of, self.tuples))

    @property
    def done(self) -> bool:
        return self.taken >= len(self.tuples)

    def covers(self, state: SnapshotState | None, position: Any) -> bool:
        """Whether this chunk's window has read the log contiguously from its start to ``position``."""
        return state == self.state and within(self.start, self.scanned_to, position)

    def saw(self, key: Any, table: str | None, keys: Sequence[tuple[Any, ...]]) -> None:
        """A change read from the log inside the window: its keys leave the chunk."""
        self.scanned_to = key
        if table == self.table:
            one = len(self.pk) == 1
            for k in keys:
                normal = k[0] if one else k
                if normal in self.keys:
                    self.dropped.add(normal)

    def take(self, n: int) -> tuple[Sequence[Any], SnapshotState]:
        """Up to ``n`` rows not dropped, and the snapshot's state once they landed.

        Its high watermark must have been read. The last take of a chunk (the rest dropped or
        taken) moves the snapshot past the chunk; an earlier one, past its last row.
        """
        tuples, key_of, dropped, i = self.tuples, self.key_of, self.dropped, self.taken
        if not dropped:
            out: Sequence[Any] = tuples[i : i + n]
            i += len(out)
        else:
            kept: list[Any] = []
            while i < len(tuples) and len(kept) < n:
                i += 1
                if key_of(tuples[i - 1]) not in dropped:
                    kept.append(tuples[i - 1])
            while i < len(tuples) and key_of(tuples[i]) in dropped:  # a dropped tail: the chunk ends now
                i += 1
            out = kept
        self.taken = i
        state = self.state
        if i < len(tuples):
            last = tuples[i - 1]
            state = replace(state, last_key=self._key_dict(last), rows=state.rows + len(out))
        else:
            state = self._finished(state, len(out), self.ready_at or dt.datetime.now(dt.UTC))
        self.state = state
        return out, state

    def next_basis(self) -> SnapshotState | None:
        """What the next chunk is read for (its table and last key), or None: this one is the last."""
        state = self.state
        if self.more:
            return replace(state, last_key=self.last_key)
        if len(state.tables) > 1:
            return replace(state, tables=state.tables[1:], last_key=None)
        return None

    def advanced(self, now: dt.datetime) -> SnapshotState:
        """The snapshot's state past this chunk when it has no row to emit (an empty select)."""
        return self._finished(self.state, 0, now)

    def _finished(self, state: SnapshotState, emitted: int, now: dt.datetime) -> SnapshotState:
        rows = state.rows + emitted
        if self.more:
            return replace(state, last_key=self.last_key, rows=rows, chunks=state.chunks + 1)
        rest = state.tables[1:]
        return replace(
            state, tables=rest, last_key=None, rows=rows, chunks=state.chunks + 1, finished_at=None if rest else now
        )

    def _key_dict(self, row: Any) -> dict[str, Any]:
        key = self.key_of(row)
        return dict(zip(self.pk, key, strict=True)) if len(self.pk) > 1 else {self.pk[0]: key}


class ChunkReader:
    """The SQL of a snapshot: primary keys, chunk selects and watermark writes (PostgreSQL)."""

    def __init__(self, config: PollerConfig, engine: sa.Engine) -> None:
        self._config = config
        self._engine = engine
        self._pks: dict[str, tuple[str, ...]] = {}
        self._columns: dict[str, frozenset[str]] = {}
        self._published = False

    def pk(self, table: str) -> tuple[str, ...]:
        if self._config.pk:
            return self._config.pk
        if table not in self._pks:
            with self._engine.connect() as conn:  # a quoted name: a mixed-case table is found as it is
                pk = tuple(conn.execute(_PRIMARY_KEY, {"table": quote_table(table)}).scalars())
            if not pk:
                raise SourceError(
                    f"poller {self._config.name}: cannot snapshot {table}: it has no primary key",
                    hint="add a primary key, or set pk to the columns that identify a row",
                )
            self._pks[table] = pk
        return self._pks[table]

    def estimate(self, tables: Sequence[str]) -> int | None:
        """Rows the tables hold by the planner's (or the activity) statistics (None when unknown)."""
        with self._engine.connect() as conn:
            counts = [conn.execute(_ESTIMATE, {"table": quote_table(t)}).scalar() for t in tables]
        known = [int(c) for c in counts if c is not None]
        return sum(known) if known and any(known) else None

    def columns(self, table: str) -> frozenset[str]:
        """The table's column names (what a ``where`` may name)."""
        if table not in self._columns:
            with self._engine.connect() as conn:
                self._columns[table] = frozenset(conn.execute(_COLUMNS, {"table": quote_table(table)}).scalars())
        return self._columns[table]

    def check_where(self, tables: Sequence[str], where: str | None) -> None:
        """Raise :class:`~poller.snapshot.where.WhereRefused` unless ``where`` is a condition of the
        grammar over the columns of every one of ``tables`` (nothing is run)."""
        if where is None:
            return
        for table in tables:
            try:
                where_sql(where, self.columns(table))
            except WhereRefused as exc:
                raise WhereRefused(f"{table}: {exc}") from exc

    def check_published(self) -> None:
        """The high watermark must reach the slot: the signal table must be in the publication."""
        if self._published:
            return
        with self._engine.connect() as conn:
            found = conn.execute(
                _PUBLISHED, {"pub": self._config.publication, "table": self._config.signal_table}
            ).first()
        if found is None:
            raise SourceError(
                f"poller {self._config.name}: a snapshot needs the signal table {self._config.signal_table} in "
                f"publication {self._config.publication}",
                hint="run `dbfanout validate --fix` (it creates the table and adds it to the publication)",
            )
        self._published = True

    def read_ahead(self, state: SnapshotState, start: Any, chunk_id: str, limit: int | None = None) -> Chunk | None:
        """:meth:`read` on a pooled connection of its own (a chunk read while the tick sends the last one's rows)."""
        with self._engine.connect() as conn:
            return self.read(conn, state, start, chunk_id, limit)

    def read(
        self,
        conn: sa.Connection,
        state: SnapshotState,
        start: Any,
        chunk_id: str | None = None,
        limit: int | None = None,
    ) -> Chunk | None:
        """Select the next chunk of ``state``'s current table and write its high watermark, on ``conn``.

        One statement (one snapshot) selects the chunk and writes the watermark row; the
        transaction commits after it (:meth:`commit_watermark`), so the watermark comes in the log
        after every change the select saw, as DBLog's separate write does, and every change it
        did not see but that committed first is inside the window. The same statement refuses
        its snapshot when a change it cannot see is already committed (see the module
        docstring): None then (retry later). An empty chunk writes no watermark. ``conn`` is left
        with no transaction open. ``limit``: rows to read this time (default: the state's chunk
        size; smaller after refusals). The condition is parsed, never pasted: a condition outside
        the grammar raises :class:`~poller.snapshot.where.WhereRefused` before anything runs.
        """
        table = state.tables[0]
        pk = self.pk(table)
        cols = ", ".join(quote_table(p) for p in pk)
        conditions: list[str] = []
        chunk_id = chunk_id or uuid.uuid4().hex
        size = min(limit or state.chunk_size, state.chunk_size)
        params: dict[str, Any] = {"n": size + 1, "poller": self._config.name, "id": chunk_id}
        if state.last_key is not None:
            binds = ", ".join(f":k{i}" for i in range(len(pk)))
            conditions.append(f"({cols}) > ({binds})")
            params.update({f"k{i}": state.last_key[p] for i, p in enumerate(pk)})
        if state.where:
            fragment, bound = where_sql(state.where, self.columns(table))
            conditions.append(f"({fragment})")
            params.update(bound)
        statement = sa.text(
            _CHUNK.format(
                table=quote_table(table),
                where=" AND ".join(conditions) or "true",
                cols=cols,
                signal=quote_table(self._config.signal_table),
            )
        )
        conn.rollback()  # whatever the connection did before (a peek): the chunk's transaction starts now
        try:
            result = conn.execute(statement, params)
            names = tuple(result.keys())[:-2]  # the row's columns, then the xmin and the racy flag
            description = result.cursor.description  # (fetch_tuples closes the result)
            fetched = postgres_rows(conn, description, fetch_tuples(result))  # a domain as its base type
            if fetched and fetched[0][-1]:  # a change the select cannot see is already committed
                conn.rollback()
                return None
            more = len(fetched) > size
            tuples = fetched[:size]
            at = [names.index(p) for p in pk]
            chunk = Chunk(
                id=params["id"],
                state=state,
                table=table,
                pk=pk,
                names=names,
                start=start,
                tuples=tuples,
                key_of=operator.itemgetter(*at),
                last_key={p: tuples[-1][i] for p, i in zip(pk, at, strict=True)} if tuples else None,
                more=more,
                scanned_to=start,
            )
            if tuples:
                self.commit_watermark(conn, chunk)
            else:
                conn.rollback()  # nothing was written
        except BaseException:
            with suppress(sa.exc.SQLAlchemyError):
                conn.rollback()
            raise
        return chunk

    def commit_watermark(self, conn: sa.Connection, chunk: Chunk) -> None:
        """Commit the chunk's transaction: its high watermark (when it has rows) enters the log here."""
        conn.commit()


def signal_of(new: Mapping[str, Any] | None, poller: str) -> tuple[str, str, dict[str, Any]] | None:
    """``(kind, id, data)`` of a signal row of ``poller`` as the log carries it (None: not ours)."""
    if not new or new.get("poller") != poller:
        return None
    kind, signal_id, data = new.get("kind"), new.get("id"), new.get("data")
    if not isinstance(kind, str) or not isinstance(signal_id, str):
        return None
    try:
        parsed = loads(data) if isinstance(data, str) else {}
    except Exception:
        parsed = {}
    return kind, signal_id, parsed if isinstance(parsed, dict) else {}

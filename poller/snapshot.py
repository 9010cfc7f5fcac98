"""Snapshots beside the stream for ``kind = "pg_logical"`` pollers: DBLog's watermark algorithm.

Why: a slot only has the changes made after it was created; the rows that already exist (and the
rows a lost slot skipped) must be read from the tables, without pausing the stream and without
ever letting a row read from the table overwrite a newer change of the same key.

How (Netflix's DBLog, as Debezium's incremental snapshots do it), one *chunk* at a time:

1. the window opens at the stream position ``P`` the chunk starts from (the low watermark: a
   position already in the log, so it needs no write of its own — see "the low watermark" below);
2. the chunk is selected by keyset on the primary key (``WHERE (pk) > (last key) ORDER BY pk
   LIMIT chunk_size``) in a REPEATABLE READ transaction;
3. a *high watermark* is written to our signal table, which is in the poller's publication, so it
   appears in the log after every change the chunk's select could have seen;
4. while the log is read from ``P`` to the high watermark, every key the log changed is dropped
   from the chunk (the log delivers that key's newer state itself);
5. at the high watermark the rest of the chunk is emitted as ``change = "read"`` events, and the
   snapshot's position (table, last key, counts) advances with the checkpoint.

A chunk row therefore reaches the handler at the log position of the high watermark, after every
change the select saw and before every change it did not: it can never overwrite a newer change,
and a key deleted meanwhile is not resurrected (its delete is in the window; the row is dropped).

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
last landed chunk. A chunk in flight lives in memory only: after a crash it is read again (its
rows keep their event ids: the id of a snapshot row is a function of its table, key and row
version — its ``xmin`` — so duplicate detection absorbs the copies).

Requests (``dbfanout snapshot``) are rows of the same signal table: they arrive through the log,
in order with the changes, and never race the poller's own state writes.
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import sqlalchemy as sa

from shared.codec import dumps, loads
from shared.config import PollerConfig
from shared.errors import SourceError
from shared.models import SnapshotState

__all__ = [
    "Chunk",
    "ChunkReader",
    "apply_request",
    "initial_state",
    "qualified",
    "quote_table",
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
_ESTIMATE = sa.text("SELECT CAST(GREATEST(reltuples, 0) AS bigint) FROM pg_class WHERE oid = to_regclass(:table)")
# A transaction our snapshot cannot see but that is already committed: its commit may precede the
# window (see the module docstring). txid_* exist from PostgreSQL 10 on.
_RACY = sa.text(
    "SELECT EXISTS (SELECT 1 FROM txid_snapshot_xip(txid_current_snapshot()) AS x(xid)"
    " WHERE txid_status(x.xid) = 'committed')"
)
_PUBLISHED = sa.text(
    "SELECT 1 FROM pg_publication_tables WHERE pubname = :pub AND schemaname || '.' || tablename = :table"
)


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
    request_id = uuid.uuid4().hex
    data: dict[str, Any] = {"action": "cancel"} if cancel else {
        "action": "snapshot",
        "tables": list(tables) if tables else None,
        "where": where,
        "chunk_size": chunk_size,
    }  # fmt: skip
    params = {"poller": config.name, "kind": KIND_REQUEST, "id": request_id, "data": dumps(data).decode()}
    return sa.text(_UPSERT.format(table=quote_table(config.signal_table))), params


def _chunk_size(config: PollerConfig, requested: Any = None) -> int:
    if isinstance(requested, int) and not isinstance(requested, bool) and requested > 0:
        return requested
    return config.snapshot_chunk_size or config.batch_size


def initial_state(config: PollerConfig, now: dt.datetime, estimate: int | None) -> SnapshotState:
    """``snapshot = "initial"``: every table of the poller, from its start."""
    return SnapshotState(
        id="initial",
        tables=tuple(qualified(t) for t in config.tables),
        chunk_size=_chunk_size(config),
        estimate=estimate,
        started_at=now,
    )


def apply_request(
    config: PollerConfig, state: SnapshotState | None, data: Mapping[str, Any], request_id: str, at: dt.datetime
) -> tuple[SnapshotState | None, str | None]:
    """The state after a request row read from the log, and a warning when it was refused."""
    action = data.get("action")
    if action == "cancel":
        if state is None or not state.active:
            return state, None
        return replace(state, tables=(), last_key=None, finished_at=at, cancelled=True), None
    if action != "snapshot":
        return state, f"request {request_id}: unknown action {action!r} ignored"
    known = [qualified(t) for t in config.tables]
    asked = data.get("tables") or known
    tables = [qualified(str(t)) for t in asked]
    unknown = [t for t in tables if t not in known]
    if unknown:
        return state, f"request {request_id}: {', '.join(unknown)} not among the poller's tables; ignored"
    where = data.get("where")
    return SnapshotState(
        id=request_id,
        tables=tuple(tables),
        chunk_size=_chunk_size(config, data.get("chunk_size")),
        where=where if isinstance(where, str) and where.strip() else None,
        started_at=at,
    ), None


@dataclass(eq=False)
class Chunk:
    """One chunk read from a table, waiting for its high watermark in the log."""

    id: str
    state: SnapshotState  # the snapshot's state it was read at (it is valid for that state only)
    table: str
    pk: tuple[str, ...]
    start: tuple[int, int] | None  # P: the stream position the window opens at
    rows: dict[tuple[Any, ...], tuple[dict[str, Any], int]]  # key -> (values, xmin)
    last_key: dict[str, Any] | None  # the last key selected (dropped or not): the next chunk starts after it
    more: bool  # the table has rows after it
    scanned_to: tuple[int, int] | None = None  # the log read so far by this chunk's window
    dropped: set[tuple[Any, ...]] = field(default_factory=set)

    def covers(self, state: SnapshotState | None, position: tuple[int, int] | None) -> bool:
        """Whether this chunk's window has read the log contiguously from its start to ``position``."""
        low, high = self.start or (-1, -1), self.scanned_to or self.start or (-1, -1)
        return state == self.state and low <= (position or (-1, -1)) <= high

    def saw(self, key: tuple[int, int], table: str | None, keys: Sequence[tuple[Any, ...]]) -> None:
        """A change read from the log inside the window: its keys leave the chunk."""
        self.scanned_to = key
        if table == self.table:
            for k in keys:
                if self.rows.pop(k, None) is not None:
                    self.dropped.add(k)

    def advanced(self, now: dt.datetime) -> SnapshotState:
        """The snapshot's state once this chunk's rows landed."""
        state = self.state
        emitted = state.rows + len(self.rows)
        if self.more:
            return replace(state, last_key=self.last_key, rows=emitted, chunks=state.chunks + 1)
        rest = state.tables[1:]
        return replace(
            state,
            tables=rest,
            last_key=None,
            rows=emitted,
            chunks=state.chunks + 1,
            finished_at=None if rest else now,
        )


class ChunkReader:
    """The SQL of a snapshot: primary keys, chunk selects and watermark writes (PostgreSQL)."""

    def __init__(self, config: PollerConfig, engine: sa.Engine) -> None:
        self._config = config
        self._engine = engine
        self._pks: dict[str, tuple[str, ...]] = {}
        self._published = False

    def pk(self, table: str) -> tuple[str, ...]:
        if self._config.pk:
            return self._config.pk
        if table not in self._pks:
            with self._engine.connect() as conn:
                pk = tuple(conn.execute(_PRIMARY_KEY, {"table": table}).scalars())
            if not pk:
                raise SourceError(
                    f"poller {self._config.name}: cannot snapshot {table}: it has no primary key",
                    hint="add a primary key, or set pk to the columns that identify a row",
                )
            self._pks[table] = pk
        return self._pks[table]

    def estimate(self, tables: Sequence[str]) -> int | None:
        """Rows the tables hold by the planner's statistics (None when never analysed)."""
        with self._engine.connect() as conn:
            counts = [conn.execute(_ESTIMATE, {"table": t}).scalar() for t in tables]
        known = [int(c) for c in counts if c is not None]
        return sum(known) if known and any(known) else None

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

    def read(self, state: SnapshotState, start: tuple[int, int] | None) -> Chunk | None:
        """Select the next chunk of ``state``'s current table and write its high watermark.

        None when the select's snapshot could miss a commit that precedes the window (retry later).
        """
        table = state.tables[0]
        pk = self.pk(table)
        cols = ", ".join(quote_table(p) for p in pk)
        conditions = []
        params: dict[str, Any] = {"n": state.chunk_size + 1}
        if state.last_key is not None:
            binds = ", ".join(f":k{i}" for i in range(len(pk)))
            conditions.append(f"({cols}) > ({binds})")
            params.update({f"k{i}": state.last_key[p] for i, p in enumerate(pk)})
        if state.where:
            conditions.append(f"({state.where})")
        where = f" WHERE {' AND '.join(conditions)}" if conditions else ""
        select = sa.text(
            f"SELECT CAST(xmin AS text) AS {XMIN}, * FROM {quote_table(table)}{where} ORDER BY {cols} LIMIT :n"
        )
        with self._engine.connect() as conn:
            conn = conn.execution_options(isolation_level="REPEATABLE READ")
            with conn.begin():
                if conn.execute(_RACY).scalar():
                    return None
                result = conn.execute(select, params)
                names = tuple(result.keys())[1:]  # the xmin first, then the row's columns
                fetched = result.fetchall()
        more = len(fetched) > state.chunk_size
        rows: dict[tuple[Any, ...], tuple[dict[str, Any], int]] = {}
        at = [names.index(p) + 1 for p in pk]
        values: dict[str, Any] | None = None
        for row in fetched[: state.chunk_size]:
            values = dict(zip(names, row[1:], strict=True))
            rows[tuple(row[i] for i in at)] = (values, int(row[0]))
        last = values
        chunk = Chunk(
            id=uuid.uuid4().hex,
            state=state,
            table=table,
            pk=pk,
            start=start,
            rows=rows,
            last_key={p: last[p] for p in pk} if last is not None else None,
            more=more,
            scanned_to=start,
        )
        if rows:  # an empty chunk needs no watermark: nothing waits for it
            self.watermark(chunk)
        return chunk

    def watermark(self, chunk: Chunk) -> None:
        """The high watermark: a committed write to the signal table, decoded in the log after it."""
        statement = sa.text(_UPSERT.format(table=quote_table(self._config.signal_table)))
        with self._engine.begin() as conn:
            conn.execute(statement, {"poller": self._config.name, "kind": KIND_WATERMARK, "id": chunk.id, "data": "{}"})


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

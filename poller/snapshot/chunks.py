"""Snapshots beside the stream: DBLog's watermark algorithm, its chunks and their one reader.

The algorithm is run by :mod:`poller.snapshot.coordinator` for every change log (``pg_logical``,
``mysql_binlog``); this module holds what every database shares: the snapshot's state
(:func:`initial_state`, :func:`chunk_size`), :class:`Chunk`, and :class:`BaseChunkReader`, the chunk
read every database runs (keyset on the primary key, the request's condition, the high watermark's
commit), whose SQL is each database's (:mod:`poller.snapshot.postgres`, :mod:`poller.snapshot.mysql`).
The signal table's rows (requests, watermarks) are :mod:`poller.snapshot.requests`. What follows
describes the algorithm on PostgreSQL.

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
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from contextlib import suppress
from dataclasses import dataclass, field, replace
from typing import Any

import sqlalchemy as sa

from poller.snapshot.where import WhereRefused, where_sql
from shared.config import PollerConfig
from shared.errors import SourceError
from shared.models import SnapshotState

__all__ = [
    "CHUNK_MAX_ROWS",
    "CHUNK_PAGES",
    "BaseChunkReader",
    "Chunk",
    "chunk_size",
    "initial_state",
    "qualified",
    "within",
]


def within(start: Any, scanned_to: Any, position: Any) -> bool:
    """Whether ``position`` lies in ``[start, scanned_to]`` (``scanned_to`` None: ``start``), over
    opaque ordered position keys where None is before the whole log."""
    if position is None:
        return start is None
    high = start if scanned_to is None else scanned_to
    return (start is None or start <= position) and high is not None and position <= high


def qualified(table: str) -> str:
    """``orders`` → ``public.orders`` (how the log names a table by default: PostgreSQL's schema)."""
    return table if "." in table else f"public.{table}"


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


class BaseChunkReader(ABC):
    """The SQL of a snapshot: primary keys, estimates, columns and chunk reads with their high watermark.

    The algorithm is here, once; a database gives its catalog queries (:meth:`_primary_key`,
    :meth:`_estimate`, :meth:`_column_names`), its key comparison (:meth:`_after_key`), the chunk's
    select with whatever must precede it (:meth:`_select`) and its watermark's write
    (:meth:`_write_watermark`, when the select did not write it). The snapshot coordinator drives
    any of them (:class:`~poller.snapshot.contracts.ChunkSource`).
    """

    #: What a missing primary key may also mean, in its error (MySQL finds no key for a missing table).
    _NO_PK = "it has no primary key"

    def __init__(self, config: PollerConfig, engine: sa.Engine) -> None:
        self._config = config
        self._engine = engine
        self._dialect = engine.dialect.name
        self._pks: dict[str, tuple[str, ...]] = {}
        self._columns: dict[str, frozenset[str]] = {}
        self._published = False

    def pk(self, table: str) -> tuple[str, ...]:
        """The columns a chunk is keyed on: ``pk`` when configured, else the table's primary key."""
        if self._config.pk:
            return self._config.pk
        if table not in self._pks:
            with self._engine.connect() as conn:
                pk = tuple(self._primary_key(conn, table))
                conn.rollback()
            if not pk:
                raise SourceError(
                    f"poller {self._config.name}: cannot snapshot {table}: {self._NO_PK}",
                    hint="add a primary key, or set pk to the columns that identify a row",
                )
            self._pks[table] = pk
        return self._pks[table]

    def estimate(self, tables: Sequence[str]) -> int | None:
        """Rows the tables hold by the database's statistics (None when unknown)."""
        with self._engine.connect() as conn:
            counts = [self._estimate(conn, t) for t in tables]
            conn.rollback()
        known = [int(c) for c in counts if c is not None]
        return sum(known) if known and any(known) else None

    def columns(self, table: str) -> frozenset[str]:
        """The table's column names (what a ``where`` may name)."""
        if table not in self._columns:
            with self._engine.connect() as conn:
                self._columns[table] = frozenset(self._column_names(conn, table))
                conn.rollback()
        return self._columns[table]

    def check_where(self, tables: Sequence[str], where: str | None) -> None:
        """Raise :class:`~poller.snapshot.where.WhereRefused` unless ``where`` is a condition of the
        grammar over the columns of every one of ``tables`` (nothing is run)."""
        if where is None:
            return
        for table in tables:
            try:
                where_sql(where, self.columns(table), self._dialect)
            except WhereRefused as exc:
                raise WhereRefused(f"{table}: {exc}") from exc

    @abstractmethod
    def check_published(self) -> None:
        """The high watermark must reach the log: raise SourceError when the signal table's rows cannot."""

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
        """Select the next chunk of ``state``'s current table and commit its high watermark, on ``conn``.

        ``start``: the stream position key the window opens at, taken before this call; the chunk
        carries it. The database's :meth:`_select` makes sure every change the select cannot see
        is after ``start`` in the log, or refuses the read: None then (retry later). An empty chunk
        writes no watermark. ``conn`` is left with no transaction open. ``limit``: rows to read
        this time (default: the state's chunk size; smaller after refusals). The condition is
        parsed, never pasted: a condition outside the grammar raises
        :class:`~poller.snapshot.where.WhereRefused` before anything runs.
        """
        table = state.tables[0]
        pk = self.pk(table)
        conditions: list[str] = []
        chunk_id = chunk_id or uuid.uuid4().hex
        size = min(limit or state.chunk_size, state.chunk_size)
        params: dict[str, Any] = {"n": size + 1}
        if state.last_key is not None:
            conditions.append(self._after_key(pk))
            params.update({f"k{i}": state.last_key[p] for i, p in enumerate(pk)})
        if state.where:
            fragment, bound = where_sql(state.where, self.columns(table), self._dialect)
            conditions.append(f"({fragment})")
            params.update(bound)
        conn.rollback()  # whatever the connection did before (a peek): the chunk's transactions start now
        try:
            selected = self._select(conn, table, pk, conditions, params, chunk_id)
            if selected is None:  # a change the select cannot see may precede the window: refused
                conn.rollback()
                return None
            names, fetched = selected
            tuples = self._tuples(names, fetched[:size])
            at = [names.index(p) for p in pk]
            chunk = Chunk(
                id=chunk_id,
                state=state,
                table=table,
                pk=pk,
                names=names,
                start=start,
                tuples=tuples,
                key_of=operator.itemgetter(*at),
                last_key={p: tuples[-1][i] for p, i in zip(pk, at, strict=True)} if tuples else None,
                more=len(fetched) > size,
                scanned_to=start,
            )
            if tuples:
                self._write_watermark(conn, chunk)
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

    # ------------------------------------------------------------------------------ each database's SQL

    @abstractmethod
    def _primary_key(self, conn: sa.Connection, table: str) -> Iterable[str]:
        """The table's primary key columns, in key order (none: no key, or no table)."""

    @abstractmethod
    def _estimate(self, conn: sa.Connection, table: str) -> int | None:
        """The table's row count by the statistics (None: unknown)."""

    @abstractmethod
    def _column_names(self, conn: sa.Connection, table: str) -> Iterable[str]:
        """The table's column names."""

    @abstractmethod
    def _after_key(self, pk: Sequence[str]) -> str:
        """The condition "the key is after ``:k0, :k1, ...``" (the last key read)."""

    @abstractmethod
    def _select(
        self,
        conn: sa.Connection,
        table: str,
        pk: Sequence[str],
        conditions: Sequence[str],
        params: dict[str, Any],
        chunk_id: str,
    ) -> tuple[tuple[str, ...], Sequence[Any]] | None:
        """The chunk's select (``:n`` rows at most, in key order, every one of ``conditions``): the
        row's column names and the rows fetched, or None: refused."""

    def _tuples(self, names: tuple[str, ...], rows: Sequence[Any]) -> Sequence[Any]:
        """A chunk's tuples from its rows: the row's columns, its version (a string), a flag."""
        return rows

    def _write_watermark(self, conn: sa.Connection, chunk: Chunk) -> None:
        """Write the chunk's high watermark in its transaction (nothing: its select wrote it)."""
        return

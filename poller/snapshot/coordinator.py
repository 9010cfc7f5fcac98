"""One snapshot coordinator for every change log: DBLog's chunks and watermarks beside the stream.

Why one: the snapshot algorithm (see :mod:`poller.snapshot.chunks`: a chunk's window, its high
watermark, the drop rule, requests and cancels read from the log, read-ahead, refusal backoff,
the emission of a chunk's rows) does not depend on which log it runs beside. Debezium's shape:
the stream and the snapshot are two change sources behind one coordinator. A log source owns only
reading its log (:class:`LogReader`) and its chunk SQL (:class:`ChunkSource`); the coordinator
owns everything else, and a fetch of the source is a fetch of the coordinator.

Positions are opaque to the coordinator: each change of a log carries a *position key*, totally
ordered (``<``) in log order — PostgreSQL's ``(commit LSN, seq)``, the binlog's
:class:`~poller.sources.mysql_binlog.position.BinlogPosition` — and ``None`` stands for "before the whole
log". The log reader turns a key into the checkpoint's :class:`~shared.models.Position` and an
event's ``cursor``, and a checkpoint back into a key.

A fetch walks the log from the checkpoint's key (:meth:`SnapshotCoordinator.fetch`): the stream's
changes become rows; the signal table's rows of this poller are requests (the snapshot state
changes there) or a chunk's high watermark (its rows may go once the log is read to its end);
every change read inside an open window drops its keys from the chunk. The snapshot's state rides
on every position returned, into the checkpoint (with no row, on the page's ``advance``).
"""

from __future__ import annotations

import datetime as dt
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, Generic, Protocol, TypeVar

import sqlalchemy as sa

from poller.ports import EventFields, Page, SourceRow
from poller.snapshot.chunks import KIND_REQUEST, KIND_WATERMARK, Chunk, apply_request, initial_state, within
from poller.snapshot.where import WhereRefused
from shared.config import PollerConfig
from shared.logs import get_logger, ids
from shared.models import CursorValue, Position, SnapshotState
from shared.telemetry import metrics

__all__ = ["ChunkSource", "Fetched", "LogChange", "LogRead", "LogReader", "SnapshotCoordinator"]

log = get_logger("poller.snapshot")

_MAX_ROUNDS = 16  # reads one fetch may take to fill its page (signals and watermarks are not rows)
_REFUSED_RETRIES = 6  # refused chunk reads retried within one fetch (backoff 5 ms doubling: ~0.3 s in all)
_REFUSED_BACKOFF, _REFUSED_BACKOFF_MAX = 0.005, 0.2
_REFUSALS_WARN = 20  # refused reads in a row that make a WARNING
_MAX_CHUNK_FAILURES = 3  # a failing chunk statement is tried this often, then its snapshot stops

#: A signal row decoded: ``(kind, id, data)`` (see :func:`poller.snapshot.chunks.signal_of`).
Signal = tuple[str, str, dict[str, Any]]


class LogChange(Protocol):
    """What the coordinator reads of a change of the log (anything else goes through the reader)."""

    @property
    def key(self) -> Any:
        """Its position key: opaque, totally ordered in log order (``<``), hashable."""

    @property
    def table(self) -> str:
        """The schema-qualified table it changed (the signal table's name for a signal row)."""


C = TypeVar("C", bound=LogChange)


@dataclass(slots=True)
class LogRead(Generic[C]):
    """Changes of the log after a position, in log order."""

    changes: Sequence[C]
    at_end: bool  # nothing follows them in the log as of this read (it was read to its end)


class LogReader(Protocol[C]):
    """What a log source gives the coordinator. Everything here reads the log or describes it;
    the snapshot's state lives in the coordinator."""

    @property
    def signal_table(self) -> str:
        """The signal table's name as the log's changes name it (``LogChange.table``)."""

    def qualify(self, table: str) -> str:
        """A configured table's name as the log's changes name it (``orders`` → ``public.orders``)."""

    def key_of(self, position: Position | None) -> Any:
        """A checkpoint's position key (None: before the whole log). Raises SourceError for a
        position another source kind wrote."""

    def changes(self, conn: sa.Connection, after: Any, want: int) -> LogRead[C]:
        """Up to ``want`` changes after key ``after`` (fewer when the log ends first; may be more
        reads of the log): the poller's tables' and the signal table's (other pollers' signal rows
        may come too: :meth:`signal` finds them not ours)."""

    def reread(self) -> None:
        """The log grew by a write of ours (a high watermark): the next :meth:`changes` must read
        the log again, not what it buffered."""

    def signal(self, change: C) -> Signal | None:
        """A signal-table change decoded (None: not a signal of this poller)."""

    def committed_at(self, change: C) -> dt.datetime:
        """When the change's transaction committed (UTC)."""

    def keys(self, conn: sa.Connection, change: C) -> list[tuple[Any, ...]]:
        """The primary keys a change touches (an update that changes the key: both)."""

    def row(self, conn: sa.Connection, change: C, state: SnapshotState | None) -> SourceRow:
        """The row (event) a change becomes, its position carrying ``state``."""

    def position(self, key: Any, state: SnapshotState | None) -> Position:
        """The checkpoint form of key ``key`` (None: before the whole log), carrying ``state``."""

    def cursor(self, key: Any) -> CursorValue:
        """The event ``cursor`` of a snapshot row emitted at key ``key`` (None: before the log)."""

    def describe(self, key: Any) -> str:
        """Key ``key`` as an operator reads it (logs; and a repeated request's id suffix)."""


class ChunkSource(Protocol):
    """A database's snapshot SQL (:class:`poller.snapshot.chunks.ChunkReader` for PostgreSQL,
    :class:`poller.snapshot.mysql.MysqlChunkReader` for MySQL/MariaDB).

    ``read`` selects the next chunk of ``state`` and commits its high watermark (a signal row the
    log then carries); the chunk's window opens at ``start``, the key the walk stood at before the
    read, so the read must make sure every change its select could not see is after ``start`` in
    the log (PostgreSQL refuses a racy snapshot: None, retried with backoff; MySQL commits a
    barrier first). ``read_ahead`` is the same on a connection of its own (a thread). A chunk's
    tuples are the row's columns (``Chunk.names``), then the row's version as a string (``t[-2]``:
    part of a snapshot event's id), then a flag.
    """

    def pk(self, table: str) -> tuple[str, ...]: ...

    def estimate(self, tables: Sequence[str]) -> int | None: ...

    def columns(self, table: str) -> frozenset[str]: ...

    def check_where(self, tables: Sequence[str], where: str | None) -> None: ...

    def check_published(self) -> None: ...

    def read(
        self,
        conn: sa.Connection,
        state: SnapshotState,
        start: Any,
        chunk_id: str | None = None,
        limit: int | None = None,
    ) -> Chunk | None: ...

    def read_ahead(self, state: SnapshotState, start: Any, chunk_id: str, limit: int | None = None) -> Chunk | None: ...


class _ChunkStopped(Exception):
    """A snapshot's chunk cannot be read (its condition is refused, its statement kept failing)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(slots=True)
class _Ahead:
    """The next chunk, read on a thread while the tick sends the current one's rows.

    Its window opens at ``start`` (where the scan stood when it was launched: every change up to
    there was read before its select began); until it is taken up, the scan keeps what it reads of
    the chunk's table (``seen``) for its drop rule, and its watermark (``ready_at``).
    """

    future: Future[Chunk | None]
    basis: SnapshotState  # the state it was read for (its table, last key, condition, size)
    chunk_id: str
    start: Any
    scanned_to: Any
    seen: list[tuple[Any, str | None, list[tuple[Any, ...]]]] = field(default_factory=list)
    ready_at: dt.datetime | None = None

    def covers(self, position: Any) -> bool:
        return within(self.start, self.scanned_to, position)

    def reads_for(self, state: SnapshotState | None) -> bool:
        """Whether it is the chunk ``state`` wants next (a request or a cancel since: no)."""
        b = self.basis
        return state is not None and state.active and (state.id, state.tables[0], state.last_key, state.where,
                                                       state.chunk_size) == (b.id, b.tables[0], b.last_key, b.where,
                                                                             b.chunk_size)  # fmt: skip


@dataclass(slots=True)
class _Scan(Generic[C]):
    """One fetch's walk along the log: the rows so far and the snapshot state they carry."""

    state: SnapshotState | None
    after: Any
    position: Any  # the last change read (rows or not)
    rows: list[SourceRow] = field(default_factory=list)
    last: C | None = None
    streamed: int = 0  # rows of changes (not of a snapshot chunk)


@dataclass(slots=True)
class Fetched(Generic[C]):
    """A fetch's page, and what the log reader needs to know of the walk behind it."""

    page: Page
    after: Any  # the key the fetch started after
    last: C | None  # the last change read (rows or not)


class SnapshotCoordinator(Generic[C]):
    """The stream of one log and the snapshots beside it, as pages (see the module docstring).

    Fetches are serial (one tick at a time); a chunk in flight, the one read ahead and the
    chunk sizes after refusals live here between fetches, in memory only.
    """

    def __init__(self, config: PollerConfig, reader: LogReader[C], chunks: ChunkSource) -> None:
        self._config = config
        self._log = reader
        self.chunks = chunks
        self._chunk: Chunk | None = None  # the chunk waiting for its high watermark (ticks are serial)
        self._owed = False  # the last page went to the stream while a chunk's rows were ready
        self._ahead: _Ahead | None = None
        self._reader: ThreadPoolExecutor | None = None  # reads the next chunk ahead (one thread, lazily)
        self._initial: SnapshotState | None = None
        self._estimates: dict[str, int | None] = {}
        self._warned: set[str] = set()
        self._limits: dict[str, int] = {}  # rows the next chunk of a snapshot reads (smaller after refusals)
        self._refused_in_a_row: dict[str, int] = {}

    # ------------------------------------------------------------------------------ the source's calls

    def fetch(self, conn: sa.Connection, after: Position | None, limit: int) -> Fetched[C]:
        """The changes after ``after``, then the rows of a snapshot chunk whose high watermark was read.

        The stream goes first: a page that found changes while a snapshot runs is handed over at
        once (marked ``more``), and a chunk's rows fill pages only once the log is read to its
        end (its window stays open meanwhile, see :class:`~poller.snapshot.chunks.Chunk`). So a change
        committed during a snapshot waits for at most about one page of chunk rows. And a page of
        the stream's is followed by one of a ready chunk's, taken without reading the log (they
        are valid where the last page ended), so a steady stream does not stall the snapshot.
        """
        key = self._log.key_of(after)
        begun = self.state_at(after)
        scan: _Scan[C] = _Scan(begun, key, key)
        more = False
        if self._owed:
            self._owed = False
            self._emit(scan, limit)
        for _ in range(_MAX_ROUNDS):
            if len(scan.rows) >= limit:
                break
            read = self._log.changes(conn, scan.position, limit - len(scan.rows))
            streamed = len(scan.rows)
            self._scan(conn, scan, read.changes)
            if len(scan.rows) >= limit or not read.at_end:
                continue
            # Caught up with the log. Changes found while a snapshot runs go now, alone: the
            # chunk's rows follow in the next page (the tick goes on: ``more``).
            if len(scan.rows) > streamed and scan.state is not None and scan.state.active:
                more = True
                break
            # A chunk whose high watermark was read fills the page up; then the next chunk is
            # read (a request or a cancel read just now counts already) and the next round reads
            # on to its watermark.
            if self._emit(scan, limit - len(scan.rows)):
                break
            if not (self._wants_chunk(scan) and self._begin_chunk(conn, scan)):
                break
        chunk = self._chunk
        self._owed = bool(scan.streamed) and chunk is not None and chunk.ready_at is not None and not chunk.done
        page = Page(scan.rows, advance=self._advance(scan, begun), more=more and len(scan.rows) < limit)
        return Fetched(page, scan.after, scan.last)

    def forget(self) -> None:
        """The log was replaced (a new slot): the chunks read against the old one are void."""
        self._chunk, self._ahead, self._owed = None, None, False

    def close(self) -> None:
        """Stop the read-ahead thread."""
        reader, self._reader, self._ahead = self._reader, None, None
        if reader is not None:
            reader.shutdown(wait=True)

    # ------------------------------------------------------------------------------ the walk

    def _advance(self, scan: _Scan[C], begun: SnapshotState | None) -> Position | None:
        """Where the checkpoint must go when the snapshot's state moved and no row carries it.

        A request, a cancel, a chunk with no row left: the position of the last change read
        (everything up to it is handled), with the new state; the tick writes it even with no
        row to send, so the change reaches the state blob in the same tick.
        """
        if scan.state == begun or (scan.rows and scan.rows[-1].position.snapshot == scan.state):
            return None
        return self._log.position(scan.position, scan.state)  # nothing read yet: before the whole log

    def _scan(self, conn: sa.Connection, scan: _Scan[C], picked: Sequence[C]) -> None:
        """Walk ``picked`` in log order: rows, snapshot requests, the chunks' windows and watermarks."""
        reader, signal_table, rows, row = self._log, self._log.signal_table, scan.rows, self._log.row
        if self._chunk is None and self._ahead is None:
            # No window open (none opens inside a walk): rows and signals only, the common case of a
            # stream's catch-up, without the per-change window bookkeeping.
            streamed = len(rows)
            for c in picked:
                if c.table == signal_table:
                    self._signal_read(scan, c, None, None)
                else:
                    rows.append(row(conn, c, scan.state))
            if picked:
                scan.last = picked[-1]
                scan.position = scan.last.key
            scan.streamed += len(rows) - streamed
            return
        for c in picked:
            chunk = self._chunk
            if chunk is not None and not chunk.covers(scan.state, scan.position):
                chunk = self._chunk = None  # read for another state, or the log was not read contiguously
            ahead = self._ahead
            if ahead is not None and not ahead.covers(scan.position):
                ahead = self._ahead = None  # the same for the chunk read ahead
            key, table = c.key, c.table
            scan.last, scan.position = c, key
            if table == signal_table:
                self._signal_read(scan, c, chunk, ahead)
                continue
            ahead_table = ahead.basis.tables[0] if ahead is not None else None
            keys = reader.keys(conn, c) if table in (chunk.table if chunk else None, ahead_table) else []
            if chunk is not None:
                chunk.saw(key, table, keys if table == chunk.table else ())
            if ahead is not None:
                ahead.scanned_to = key
                if table == ahead_table:
                    ahead.seen.append((key, table, keys))
            rows.append(row(conn, c, scan.state))
            scan.streamed += 1

    def _signal_read(self, scan: _Scan[C], c: C, chunk: Chunk | None, ahead: _Ahead | None) -> None:
        """A change of the signal table: a request of ours, a chunk's high watermark, or nothing of ours."""
        if chunk is not None:
            chunk.saw(c.key, None, ())
        if ahead is not None:
            ahead.scanned_to = c.key
        signal = self._log.signal(c)
        if signal is None:
            return
        kind, signal_id, data = signal
        if kind == KIND_REQUEST:
            self._request(scan, c, signal_id, data)
        elif kind == KIND_WATERMARK and chunk is not None and chunk.id == signal_id:
            # The high watermark: every change the select could have missed is behind us; the
            # chunk's rows go once the log is read to its end (_emit).
            chunk.ready_at = self._log.committed_at(c)
        elif kind == KIND_WATERMARK and ahead is not None and ahead.chunk_id == signal_id:
            ahead.ready_at = self._log.committed_at(c)

    def _request(self, scan: _Scan[C], c: C, signal_id: str, data: dict[str, Any]) -> None:
        """A ``dbfanout snapshot`` request read from the log: the snapshot state changes here."""
        where = self._log.describe(c.key)
        if scan.state is not None and signal_id == scan.state.id:
            # A request row written by hand with the last run's id: the run's event ids must
            # differ from that run's, or a repair would be absorbed as duplicates (its log
            # position is the same whenever this request is read again).
            signal_id = f"{signal_id}@{where}"
        at = self._log.committed_at(c)
        state, warning = apply_request(self._config, scan.state, data, signal_id, at, qualify=self._log.qualify)
        if warning:
            self._warn_once(f"request-{signal_id}", "%s", warning)
        if state is not None and state.active and state.where is not None:
            try:  # a condition is checked before anything of it runs (a request may come from anyone)
                self.chunks.check_where(state.tables, state.where)
            except WhereRefused as exc:
                log.error("poller %s: snapshot %s refused: where %s", self._config.name, signal_id, exc,
                          extra=ids(poller=self._config.name))  # fmt: skip
                state = replace(state, tables=(), finished_at=at, error=f"where refused: {exc}")
        if state == scan.state:
            return
        if state is not None and state.active and state.estimate is None:
            if state.id not in self._estimates:
                self._estimates[state.id] = self.chunks.estimate(state.tables)
            state = replace(state, estimate=self._estimates[state.id])
        log.info("poller %s: snapshot %s %s at %s", self._config.name, signal_id,
                 "cancelled" if state is not None and state.cancelled else "requested", where,
                 extra=ids(poller=self._config.name))  # fmt: skip
        scan.state, self._chunk = state, None

    def state_at(self, after: Position | None) -> SnapshotState | None:
        """The snapshot state a fetch starts with: the checkpoint's, or the initial one on a first start."""
        if after is not None:
            return after.snapshot
        if self._config.snapshot != "initial":
            return None
        if self._initial is None:  # one per process: a chunk read for it stays valid across fetches
            qualify = self._log.qualify
            estimate = self.chunks.estimate([qualify(t) for t in self._config.tables])
            self._initial = initial_state(self._config, dt.datetime.now(dt.UTC), estimate, qualify=qualify)
        return self._initial

    # ------------------------------------------------------------------------------ chunks

    def _wants_chunk(self, scan: _Scan[C]) -> bool:
        """Whether a snapshot is running with no chunk in flight for where the scan stands."""
        state = scan.state
        if state is None or not state.active:
            return False
        return self._chunk is None or not self._chunk.covers(state, scan.position)

    def _begin_chunk(self, conn: sa.Connection, scan: _Scan[C]) -> bool:
        """Read the next chunk (and write its high watermark) when a snapshot runs and none is in flight.

        Tables (or their rest) with no row left are passed at once; the scan's state moves on.
        False when a chunk was due but had to wait (a commit its select could not see yet).
        """
        while self._wants_chunk(scan):
            state = scan.state
            assert state is not None
            self.chunks.check_published()
            ahead = self._take_ahead(scan)
            if ahead is not None:
                if ahead.tuples:
                    self._chunk = ahead  # its watermark: read already, or in the log after the last read
                    return True
                scan.state = ahead.advanced(dt.datetime.now(dt.UTC))
                continue
            try:
                chunk, scan.state = self._read_chunk(conn, state, scan.position)
            except _ChunkStopped as stopped:
                # A condition outside the grammar, or a select that kept failing (a timeout, a
                # permission, a dropped column): stop the snapshot rather than fail every tick, so
                # the changes keep flowing and a new request can come.
                log.error("poller %s: snapshot %s of %s stopped: %s", self._config.name, state.id, state.tables[0],
                          stopped.reason, extra=ids(poller=self._config.name))  # fmt: skip
                scan.state = replace(state, tables=(), last_key=None, finished_at=dt.datetime.now(dt.UTC),
                                     error=f"{state.tables[0]}: {stopped.reason}")  # fmt: skip
                return True
            if chunk is None:  # read it on a later fetch
                return False
            if chunk.tuples:
                self._chunk = chunk
                self._log.reread()  # the next read must read past the watermark just written
                return True
            scan.state = chunk.advanced(dt.datetime.now(dt.UTC))
        return True

    def _read_chunk(self, conn: sa.Connection, state: SnapshotState, start: Any) -> tuple[Chunk | None, SnapshotState]:
        """The next chunk of ``state`` read now, and the snapshot's state it is valid for.

        A refused read (a committed transaction not visible yet: a synchronous standby's wait,
        a busy server) is retried at once with backoff and half the rows, up to
        :data:`_REFUSED_RETRIES` times in this fetch; the refusals are counted in the state
        (``status``), the metric ``dbfanout.snapshot_chunks_refused`` and, after
        :data:`_REFUSALS_WARN` in a row, a WARNING. A statement that fails (a timeout, a
        permission) is tried again on later fetches, :data:`_MAX_CHUNK_FAILURES` times in all,
        then raises :class:`_ChunkStopped`; so does a condition outside the grammar, at once.
        None: read it on a later fetch.
        """
        name, refused = self._config.name, 0
        for attempt in range(_REFUSED_RETRIES):
            basis = replace(state, refused=state.refused + refused, failures=0)
            limit = self._limits.get(state.id, state.chunk_size)
            try:
                chunk = self.chunks.read(conn, basis, start, limit=limit)
            except WhereRefused as exc:
                raise _ChunkStopped(f"where refused: {exc}") from exc
            except sa.exc.DBAPIError as exc:
                if exc.connection_invalidated:  # the source is down: the tick fails, as for the stream
                    raise
                problem = str(exc.orig or exc).splitlines()[0]
                failures = state.failures + 1  # counted in the state: a restart does not reset it
                if failures >= _MAX_CHUNK_FAILURES:
                    raise _ChunkStopped(f"{problem} ({failures} tries)") from exc
                log.warning("poller %s: snapshot %s: chunk of %s failed (%s); tried again on the next fetch (%d of %d)",
                            name, state.id, state.tables[0], problem, failures, _MAX_CHUNK_FAILURES,
                            extra=ids(poller=name))  # fmt: skip
                return None, replace(basis, failures=failures)
            if chunk is not None:
                self._grow(state)
                return chunk, basis
            refused += 1
            metrics.snapshot_chunks_refused.add(1, {"poller": name})
            self._limits[state.id] = max(1, limit // 2)
            in_a_row = self._refused_in_a_row[state.id] = self._refused_in_a_row.get(state.id, 0) + 1
            if in_a_row >= _REFUSALS_WARN:
                self._warn_once(f"refused-{state.id}", "snapshot %s: %d chunk reads of %s refused in a row: a "
                                "transaction committed but not visible yet (a synchronous standby, a busy server); "
                                "retrying with backoff and smaller chunks (see `dbfanout status`, metric "
                                "dbfanout.snapshot_chunks_refused)", state.id, in_a_row, state.tables[0])  # fmt: skip
            log.debug("poller %s: snapshot chunk refused (a commit not yet visible)", name)
            time.sleep(min(_REFUSED_BACKOFF * 2**attempt, _REFUSED_BACKOFF_MAX))
        return None, replace(state, refused=state.refused + refused, failures=0)

    def _grow(self, state: SnapshotState) -> None:
        """A chunk was read: the next one reads twice as many rows, back to the full size step by step."""
        self._refused_in_a_row.pop(state.id, None)
        if state.id in self._limits:
            self._limits[state.id] = min(self._limits[state.id] * 2, state.chunk_size)

    def _read_ahead(self, chunk: Chunk, position: Any) -> None:
        """Start reading the chunk after ``chunk`` on the read-ahead thread, its window opening at
        ``position`` (the log is read to there, and the select begins later)."""
        basis = chunk.next_basis()
        if basis is None:
            return
        if self._reader is None:
            self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"snapshot-{self._config.name}")
        chunk_id = uuid.uuid4().hex
        limit = self._limits.get(basis.id)
        future = self._reader.submit(self.chunks.read_ahead, basis, position, chunk_id, limit)
        self._ahead = _Ahead(future, basis, chunk_id, position, position)

    def _take_ahead(self, scan: _Scan[C]) -> Chunk | None:
        """The chunk read ahead, when it is the one the scan wants, with what the scan saw since it
        began applied to it (None: read one now)."""
        ahead, self._ahead = self._ahead, None
        if ahead is None or not ahead.reads_for(scan.state) or not ahead.covers(scan.position):
            return None
        try:
            chunk = ahead.future.result()
        except Exception as exc:  # read it again in the tick's thread: a lasting error is raised there
            log.debug("poller %s: chunk read ahead failed: %r", self._config.name, exc)
            return None
        if chunk is None:  # its snapshot was refused (a commit not yet visible)
            return None
        assert scan.state is not None
        self._grow(scan.state)
        chunk.state = scan.state
        for key, table, keys in ahead.seen:
            chunk.saw(key, table, keys)
        chunk.scanned_to, chunk.ready_at = ahead.scanned_to, ahead.ready_at
        return chunk

    def _emit(self, scan: _Scan[C], room: int) -> bool:
        """Up to ``room`` rows of the chunk whose high watermark was read, as ``read`` events at the
        scan's position (the log is read to there: every key it changed left the chunk).

        Whether the page is full.
        """
        chunk = self._chunk
        if chunk is None or chunk.ready_at is None or not chunk.covers(scan.state, scan.position):
            return False
        if self._ahead is None:
            self._read_ahead(chunk, scan.position)
        taken, state = chunk.take(room)
        scan.state = state
        scan.rows.extend(self._chunk_rows(chunk, taken, scan.position, state))
        if chunk.done:
            self._chunk = None
            log.info("poller %s: snapshot %s: %d row(s) of %s read at %s (%d dropped: changed meanwhile)",
                     self._config.name, state.id, len(chunk.tuples) - len(chunk.dropped), chunk.table,
                     self._log.describe(scan.last.key) if scan.last is not None else None, len(chunk.dropped),
                     extra=ids(poller=self._config.name))  # fmt: skip
        return len(taken) >= room

    def _chunk_rows(self, chunk: Chunk, taken: Sequence[Any], at: Any, state: SnapshotState) -> list[SourceRow]:
        """Chunk rows as ``read`` events at log position ``at``."""
        position = self._log.position(at, state)
        cursor = self._log.cursor(at)
        names, table, prefix = chunk.names, chunk.table, f"read/{state.id}/{chunk.table}/"
        # Positional arguments: a chunk is thousands of rows, built here one by one. The version
        # (snapshot run, table and row version: PostgreSQL's xmin) is what a re-read of the same
        # row version within one run gets the same event id from; another run's read of it is a
        # new event (a repair delivers). zip stops at the names: the version (and a flag) after
        # them are not columns of the row.
        if len(chunk.pk) == 1:
            name, i = chunk.pk[0], names.index(chunk.pk[0])
            return [
                SourceRow(position, dict(zip(names, t)), False,  # noqa: B905
                          EventFields({name: t[i]}, cursor, "read", None, table, prefix + t[-2]))
                for t in taken
            ]  # fmt: skip
        key_of, pk = chunk.key_of, chunk.pk
        return [
            SourceRow(position, dict(zip(names, t)), False,  # noqa: B905
                      EventFields(dict(zip(pk, key_of(t), strict=True)), cursor, "read", None, table, prefix + t[-2]))
            for t in taken
        ]  # fmt: skip

    def _warn_once(self, key: str, message: str, *args: Any) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning("poller %s: " + message, self._config.name, *args, extra=ids(poller=self._config.name))

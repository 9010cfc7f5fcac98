"""One snapshot coordinator for every change log: DBLog's chunks and watermarks beside the stream.

Why one: the snapshot algorithm (see :mod:`poller.snapshot.chunks`: a chunk's window, its high
watermark, the drop rule, requests and cancels read from the log, read-ahead, refusal backoff,
the emission of a chunk's rows) does not depend on which log it runs beside. Debezium's shape:
the stream and the snapshot are two change sources behind one coordinator. A log source owns only
reading its log (:class:`~poller.snapshot.contracts.LogReader`) and its chunk SQL
(:class:`~poller.snapshot.contracts.ChunkSource`); the coordinator owns everything else (the chunk
reads' refusals, failures and read-ahead: :mod:`poller.snapshot.reads`), and a fetch of the source
is a fetch of the coordinator.

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

Its size (a little over 400 lines) is the walk itself: the scan, the requests it reads and the
chunks it emits share one scan state, and splitting them would thread that state through modules.
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Generic

import sqlalchemy as sa

from poller.ports import EventFields, Page, SourceRow
from poller.snapshot.chunks import Chunk
from poller.snapshot.contracts import C, ChunkSource, LogReader
from poller.snapshot.reads import Ahead, ChunkReads, ChunkStopped
from poller.snapshot.requests import (
    KIND_REQUEST,
    KIND_WATERMARK,
    MAX_KEPT_TEXT,
    MAX_REQUEST_ID,
    apply_request,
    bounded,
    failed_request,
    initial_state,
)
from poller.snapshot.where import WhereRefused
from shared.config import PollerConfig
from shared.logs import get_logger, ids
from shared.models import Position, SnapshotState
from shared.scrub import describe_error
from shared.telemetry import metrics

__all__ = ["Fetched", "SnapshotCoordinator"]

log = get_logger("poller.snapshot")

_MAX_ROUNDS = 16  # reads one fetch may take to fill its page (signals and watermarks are not rows)


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
        self._ahead: Ahead | None = None
        self._reads = ChunkReads(config.name, self._warn_once)
        self._initial: SnapshotState | None = None
        self._estimates: dict[str, int | None] = {}
        self._warned: set[str] = set()

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
        self._ahead = None
        self._reads.close()

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

    def _signal_read(self, scan: _Scan[C], c: C, chunk: Chunk | None, ahead: Ahead | None) -> None:
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
        """A ``dbfanout snapshot`` request read from the log: the snapshot state changes here.

        A request is input from anyone who can write the signal table: whatever it holds, and
        whatever checking it raises, it ends as a refused request and the stream goes on in the
        same fetch (an exception here would fail every fetch that reaches the row, for good)."""
        try:
            self._apply_request(scan, c, signal_id, data)
        except Exception as exc:
            reason = f"could not be applied: {describe_error(exc)}"
            self._refused(signal_id, reason)
            if scan.state is None or not scan.state.active:
                at = self._log.committed_at(c)
                scan.state, self._chunk = failed_request(self._config, signal_id, at, reason), None

    def _refused(self, signal_id: str, reason: str) -> None:
        """Warn and count a refused request once (a tick may read its row again before it commits)."""
        key = f"request-{signal_id}"
        if key not in self._warned:
            metrics.failures.add(1, {"stage": "snapshot-request", "poller": self._config.name})
        self._warn_once(key, "snapshot request %s: %s", bounded(str(signal_id), MAX_REQUEST_ID), reason)

    def _apply_request(self, scan: _Scan[C], c: C, signal_id: str, data: dict[str, Any]) -> None:
        where = self._log.describe(c.key)
        if scan.state is not None and signal_id == scan.state.id:
            # A request row written by hand with the last run's id: the run's event ids must
            # differ from that run's, or a repair would be absorbed as duplicates (its log
            # position is the same whenever this request is read again).
            signal_id = f"{signal_id}@{where}"
        at = self._log.committed_at(c)
        state, warning = apply_request(self._config, scan.state, data, signal_id, at, qualify=self._log.qualify)
        if warning:
            self._refused(signal_id, warning)
        if state is not None and state.active and state.where is not None:
            try:  # a condition is checked before anything of it runs (a request may come from anyone)
                self.chunks.check_where(state.tables, state.where)
            except WhereRefused as exc:
                log.error("poller %s: snapshot %s refused: where %s", self._config.name, signal_id, exc,
                          extra=ids(poller=self._config.name))  # fmt: skip
                metrics.failures.add(1, {"stage": "snapshot-request", "poller": self._config.name})
                error = bounded(f"where refused: {exc}", 2 * MAX_KEPT_TEXT)  # kept in every checkpoint: bounded
                state = replace(state, tables=(), finished_at=at, error=error, where=bounded(state.where))
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
                chunk, scan.state = self._reads.read(self.chunks, conn, state, scan.position)
            except ChunkStopped as stopped:
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

    def _read_ahead(self, chunk: Chunk, position: Any) -> None:
        """Start reading the chunk after ``chunk`` on the read-ahead thread, its window opening at
        ``position`` (the log is read to there, and the select begins later)."""
        basis = chunk.next_basis()
        if basis is None:
            return
        chunk_id = uuid.uuid4().hex
        future = self._reads.submit(self.chunks, basis, position, chunk_id)
        self._ahead = Ahead(future, basis, chunk_id, position, position)

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
        self._reads.grow(scan.state)
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

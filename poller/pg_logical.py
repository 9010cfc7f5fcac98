"""The ``kind = "pg_logical"`` source: every change, hard deletes included, from a replication slot.

Why this read path: the slot is read with SQL functions over the pinned psycopg 3 driver through
SQLAlchemy (``pg_logical_slot_peek_binary_changes``, ``pg_replication_slot_advance``) — no
replication-protocol connection, nothing new to deploy. Why ``pgoutput``: it is built into
PostgreSQL 10+ and offered by every managed server (Azure Database for PostgreSQL Flexible Server
included), with no extension to install; it only decodes the tables of a publication.

The tick's order keeps the at-least-once contract with no settle window:

1. ``fetch`` *peeks* (reads without consuming) the changes committed after the checkpoint, in
   commit order; each change's position is ``(commit LSN, seq)`` — ``seq`` its place in the
   transaction — and the checkpoint cursor is ``{kind: "pg_lsn", value: commit LSN,
   tiebreaker: {"seq": n}}``. A transaction larger than a page is split across pages and ticks;
   one larger than a peek's cap is read from the slot once, into a local spool the next pages
   come from (:mod:`poller.pg_spool`), until the slot is past it.
2. the tick sends the page (event ids from the position: duplicate detection drops re-sends);
3. the tick commits the checkpoint (CAS, fencing);
4. only then ``acknowledge`` advances the slot to what the landed checkpoint covers.

A crash anywhere re-reads from the slot, which may be behind the checkpoint: changes at or
before the checkpoint are skipped. The slot and the publication are created by
``dbfanout validate --fix`` (or :func:`setup_sql`), never at tick time.

Snapshots (``snapshot = "initial"``, ``dbfanout snapshot``) run inside the same fetches: the rows
that already exist are read in chunks beside the stream, emitted from their high watermark's log
position on, with DBLog's rule that a key the log changed meanwhile leaves the chunk (see
:mod:`poller.snapshot`); the stream's changes go first; the snapshot's state rides on every
position returned, into the checkpoint (with no row, on the page's ``advance``).
"""

from __future__ import annotations

import bisect
import datetime as dt
import threading
import time
import uuid
from collections.abc import Generator, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager, closing, contextmanager, suppress
from dataclasses import dataclass, field, replace
from typing import Any

import sqlalchemy as sa

from poller.engines import db_errors, require_driver, source_engine
from poller.pg_slot import SlotGuard
from poller.pg_spool import Spool
from poller.pgoutput import Change, Decoder, Relation
from poller.ports import EventFields, Page, SourceRow
from poller.snapshot import (
    KIND_REQUEST,
    KIND_WATERMARK,
    Chunk,
    ChunkReader,
    apply_request,
    initial_state,
    qualified,
    signal_of,
    signal_sql,
)
from poller.snapshot_where import WhereRefused
from shared.config import PollerConfig
from shared.errors import ConfigError, PositionLostError, SourceError
from shared.ids import source_fingerprint
from shared.logs import get_logger, ids
from shared.models import Checkpoint, Lsn, Position, SnapshotState
from shared.settings import fingerprint_url, redact_url
from shared.telemetry import metrics

__all__ = ["PgLogicalSource", "setup_sql"]

log = get_logger("poller.pg_logical")

_PEEK_SQL = (
    "SELECT data FROM pg_logical_slot_peek_binary_changes("
    "CAST(%(slot)s AS name), NULL, %(n)s, 'proto_version', '1', 'publication_names', %(pub)s)"
)
_FLUSH = sa.text("SELECT CAST(pg_current_wal_flush_lsn() AS text)")
_SLOT = sa.text(
    "SELECT plugin, database, CAST(confirmed_flush_lsn AS text) AS confirmed, active, wal_status,"
    " pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn) AS retained_bytes,"
    " pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn) AS lag_bytes"
    " FROM pg_replication_slots WHERE slot_name = :slot"
)
_ADVANCE = sa.text(
    "SELECT pg_replication_slot_advance(CAST(:slot AS name), CAST(:lsn AS pg_lsn)) FROM pg_replication_slots"
    " WHERE slot_name = :slot AND confirmed_flush_lsn < CAST(:lsn AS pg_lsn)"
)
_PRIMARY_KEY = sa.text(
    "SELECT a.attname FROM pg_index i CROSS JOIN LATERAL unnest(i.indkey) WITH ORDINALITY AS k(attnum, n)"
    " JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum"
    " WHERE i.indrelid = :oid AND i.indisprimary ORDER BY k.n"
)
_MIN_PEEK = 1024  # messages per peek at least
_MESSAGES_PER_CHANGE = 3  # a change is one message; a one-change transaction adds Begin and Commit
_PAGES_PER_PEEK = 4  # a peek decodes about this many pages (a tick's next pages come from its buffer)
_STREAM_ROWS = 1000  # messages fetched per round trip while streaming a peek
_MAX_ROUNDS = 16  # peeks one fetch may take to fill its page (signals and watermarks are not rows)
#: A peek holds this many bytes of raw messages at most; past them it writes them to a spool as
#: it goes (kept only when it stops inside a transaction larger than the cap: see _peek).
_SPOOL_AFTER_BYTES = 8 << 20
_PG_EPOCH = dt.datetime(2000, 1, 1, tzinfo=dt.UTC)
_REFUSED_RETRIES = 6  # refused chunk reads retried within one fetch (backoff 5 ms doubling: ~0.3 s in all)
_REFUSED_BACKOFF, _REFUSED_BACKOFF_MAX = 0.005, 0.2
_REFUSALS_WARN = 20  # refused reads in a row that make a WARNING
_MAX_CHUNK_FAILURES = 3  # a failing chunk statement is tried this often, then its snapshot stops


class _ChunkStopped(Exception):
    """A snapshot's chunk cannot be read (its condition is refused, its statement kept failing)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def setup_sql(config: PollerConfig) -> list[str]:
    """The statements that create the signal table, the publication, then the slot (that order: see the docs).

    The publication holds the poller's tables and the snapshot signal table (poller.snapshot):
    a snapshot's watermarks and requests reach the poller through the slot.
    """
    tables = ", ".join(_quote_table(t) for t in (*config.tables, config.signal_table))
    return [
        *signal_sql(config),
        f"CREATE PUBLICATION {config.publication} FOR TABLE {tables} WITH (publish = 'insert, update, delete')",
        f"SELECT pg_create_logical_replication_slot('{config.slot}', 'pgoutput')",
    ]


def _quote_table(name: str) -> str:
    return ".".join('"' + part.replace('"', '""') + '"' for part in name.split("."))


@dataclass(slots=True)
class _Buffer:
    """The changes after a fetch position, decoded by this tick's last peek (the slot does not move within a tick)."""

    changes: list[Change]
    keys: list[tuple[int, int]]
    exhausted: bool  # the peek reached the end of the log
    flushed: Lsn  # the log's flush position before that peek
    messages: int  # how many the peek read (a re-peek reads past them again)


class _Tape:
    """A peek's raw messages: in memory, then in a spool once they pass :data:`_SPOOL_AFTER_BYTES`."""

    def __init__(self) -> None:
        self._held: list[bytes] = []
        self._bytes = 0
        self._spool: Spool | None = None

    def write(self, data: bytes) -> None:
        if self._spool is not None:
            self._spool.write(data)
            return
        self._held.append(data)
        self._bytes += len(data)
        if self._bytes > _SPOOL_AFTER_BYTES:
            self.spool()

    def spool(self) -> Spool:
        """The messages so far in a spool (which then takes the next ones)."""
        if self._spool is None:
            self._spool = Spool()
            self._spool.write_all(self._held)
            self._held, self._bytes = [], 0
        return self._spool

    def close(self) -> None:
        """Free what was held, and the spool unless it was finished (kept by the source)."""
        self._held = []
        if self._spool is not None and self._spool.last_key is None:
            self._spool.close()


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
    start: tuple[int, int] | None
    scanned_to: tuple[int, int] | None
    seen: list[tuple[tuple[int, int], str | None, list[tuple[Any, ...]]]] = field(default_factory=list)
    ready_at: dt.datetime | None = None

    def covers(self, position: tuple[int, int] | None) -> bool:
        low, high = self.start or (-1, -1), self.scanned_to or self.start or (-1, -1)
        return low <= (position or (-1, -1)) <= high

    def reads_for(self, state: SnapshotState | None) -> bool:
        """Whether it is the chunk ``state`` wants next (a request or a cancel since: no)."""
        b = self.basis
        return state is not None and state.active and (state.id, state.tables[0], state.last_key, state.where,
                                                       state.chunk_size) == (b.id, b.tables[0], b.last_key, b.where,
                                                                             b.chunk_size)  # fmt: skip


@dataclass(slots=True)
class _Scan:
    """One fetch's walk along the log: the rows so far and the snapshot state they carry."""

    state: SnapshotState | None
    after: tuple[int, int] | None
    position: tuple[int, int] | None  # the last change read (rows or not)
    rows: list[SourceRow] = field(default_factory=list)
    last: Change | None = None
    streamed: int = 0  # rows of changes (not of a snapshot chunk)


class PgLogicalSource:
    """The :class:`~poller.ports.Source` port over a logical replication slot (``pgoutput``)."""

    #: Changes one peek decodes at most (memory bound: a huge transaction is read in parts; a
    #: larger part means fewer peeks, each of which the server decodes from the slot's position).
    MAX_DECODED = 20_000

    def __init__(self, config: PollerConfig, engine: sa.Engine | None = None) -> None:
        if config.kind != "pg_logical" or not config.slot or not config.publication:
            raise ConfigError(f"pollers.{config.name}.kind", 'PgLogicalSource needs kind = "pg_logical"')
        # psycopg 3 is an optional driver: checked (and imported) only when a pg_logical poller opens
        require_driver("psycopg", f"pollers.{config.name}", 'kind = "pg_logical"', label="psycopg 3")
        self._config = config
        self._engine = source_engine(config, engine)
        if self._engine.dialect.name != "postgresql":
            raise ConfigError(
                f"pollers.{config.name}.kind",
                f'kind = "pg_logical" needs PostgreSQL 10+ (this source is {self._engine.dialect.name})',
            )
        self._slot, self._publication = config.slot, config.publication
        self._url = redact_url(config.source_url)
        self._fingerprint = source_fingerprint(
            {
                "url": fingerprint_url(config.source_url),
                "kind": "pg_logical",
                "tables": list(config.tables),
                "slot": self._slot,
                "publication": self._publication,
                "pk": list(config.pk),
            }
        )
        self._pks: dict[int, tuple[str, ...]] = {}
        self._signal = config.signal_table
        self._chunks = ChunkReader(config, self._engine)
        self._chunk: Chunk | None = None  # the chunk waiting for its high watermark (ticks are serial)
        self._owed = False  # the last page went to the stream while a chunk's rows were ready
        self._ahead: _Ahead | None = None
        self._reader: ThreadPoolExecutor | None = None  # reads the next chunk ahead (one thread, lazily)
        self._initial: SnapshotState | None = None
        self._estimates: dict[str, int | None] = {}
        self._guard = SlotGuard(config, self._engine, self._url, self._chunks.estimate, self._forget_log)
        self._local = threading.local()  # pinned connection and this tick's buffer, per thread
        self._warned: set[str] = set()
        self._limits: dict[str, int] = {}  # rows the next chunk of a snapshot reads (smaller after refusals)
        self._refused_in_a_row: dict[str, int] = {}
        # Where the slot may go once a position a page ended at is a landed checkpoint; shared by
        # the threads a tick's pages are read on, cleared by acknowledge.
        self._hints: dict[tuple[int, int], Lsn] = {}
        # A transaction larger than MAX_DECODED, read once from the slot (poller.pg_spool): pages
        # come from it until the slot is past it. Fetches are serial (one tick at a time).
        self._spool: Spool | None = None

    # ------------------------------------------------------------------------------ the port

    @property
    def fingerprint(self) -> str:
        return self._fingerprint

    def fetch(self, after: Position | None, limit: int) -> Page:
        try:
            with self._connection("fetch") as conn:
                return self._fetch(conn, after, limit)
        except SourceError as exc:
            if isinstance(exc, PositionLostError) or _sqlstate(exc) is None:
                raise  # lost already said, or the server did not answer (nothing to ask it then)
            # The server refused the read: its slot may be lost meanwhile. Say so (or recover).
            recovery = self._recheck(after)
            if recovery is not None:
                return recovery
            raise

    @contextmanager
    def pinned(self) -> Iterator[None]:
        """One connection and one decoded buffer for a tick's fetches (the slot does not move meanwhile)."""
        self._local.pinning, self._local.conn, self._local.buffer = True, None, None
        self._guard.new_tick()
        try:
            yield
        finally:
            conn = self._local.conn
            self._local.pinning, self._local.conn, self._local.buffer = False, None, None
            if conn is not None:
                with suppress(sa.exc.SQLAlchemyError):
                    conn.close()

    def acknowledge(self, checkpoint: Checkpoint) -> None:
        """Advance the slot to what ``checkpoint`` (a landed write) covers; never past it.

        To the end of the checkpoint's transaction when it was delivered whole, to its commit LSN
        otherwise (the slot then re-sends it and the rest is read past the checkpoint); when the
        last peek found nothing after the checkpoint, to the log position that peek read to, so
        an idle slot does not hold WAL back. Best effort: the next tick acknowledges again.
        """
        key = _key(checkpoint.position)
        if key is None:
            return
        target = self._hints.pop(key, Lsn(key[0]))  # unknown: its commit LSN (its transaction stays)
        self._hints.clear()  # the others are behind this landed checkpoint (or were never sent)
        spool = self._spool
        passed = spool is not None and spool.passed_by(key)
        if passed and spool is not None and spool.end_lsn is not None:
            target = Lsn(max(target, spool.end_lsn))  # the spooled transaction was delivered whole
        try:
            with self._connection("acknowledge") as conn:
                conn.execute(_ADVANCE, {"slot": self._slot, "lsn": str(target)})
                conn.commit()
                if passed and spool is self._spool:
                    self._drop_spool()  # the slot is past it: the next peek starts after it
                retained = conn.execute(_SLOT, {"slot": self._slot}).mappings().first()
                conn.rollback()
            if retained is not None:  # the WAL the slot still holds back (operators alert on it)
                attrs = {"poller": self._config.name, "slot": self._slot}
                metrics.retained_wal_bytes.record(int(retained["retained_bytes"] or 0), attrs)
                metrics.lag_wal_bytes.record(int(retained["lag_bytes"] or 0), attrs)
        except SourceError as exc:  # FetchError included: nothing is lost, the slot just lags
            log.warning(
                "poller %s: could not advance slot %s to %s: %s", self._config.name, self._slot, target, exc,
                extra=ids(poller=self._config.name),
            )  # fmt: skip

    def close(self) -> None:
        """Stop the read-ahead thread; the engine is shared per URL (see :func:`poller.engines.dispose_engines`)."""
        reader, self._reader, self._ahead = self._reader, None, None
        if reader is not None:
            reader.shutdown(wait=True)
        self._drop_spool()

    def forget(self) -> None:
        """The lease went to another process: drop the spool (it delivers the transaction meanwhile,
        and a later fetch here reads the slot again from the checkpoint it finds)."""
        self._drop_spool()

    @property
    def spool_bytes(self) -> int:
        """Bytes of the local spool of a huge transaction (0: none)."""
        spool = self._spool
        return spool.size if spool is not None else 0

    # ------------------------------------------------------------------------------ operator surface

    @property
    def slot(self) -> str:
        return self._slot

    def slot_status(self) -> dict[str, Any] | None:
        """The slot as ``pg_replication_slots`` shows it (None when it does not exist)."""
        with self._connection("slot status") as conn:
            row = conn.execute(_SLOT, {"slot": self._slot}).mappings().first()
            conn.rollback()
        if row is None:
            return None
        return {
            "slot": self._slot,
            "publication": self._publication,
            "plugin": row["plugin"],
            "active": bool(row["active"]),
            "wal_status": row["wal_status"],
            "confirmed_flush_lsn": row["confirmed"],
            "retained_wal_bytes": int(row["retained_bytes"] or 0),
            "lag_bytes": int(row["lag_bytes"] or 0),
        }

    # ------------------------------------------------------------------------------ reading

    def _fetch(self, conn: sa.Connection, after: Position | None, limit: int) -> Page:
        """The changes after ``after``, then the rows of a snapshot chunk whose high watermark was read.

        The stream goes first: a page that found changes while a snapshot runs is handed over at
        once (marked ``more``), and a chunk's rows fill pages only once the log is read to its
        end (its window stays open meanwhile, see :class:`~poller.snapshot.Chunk`). So a change
        committed during a snapshot waits for at most about one page of chunk rows. And a page of
        the stream's is followed by one of a ready chunk's, taken without reading the log (they
        are valid where the last page ended), so a steady stream does not stall the snapshot.
        """
        recovery = self._guard.check(conn, after)  # the slot lost: an error, or (opt-in) a resnapshot
        if recovery is not None:
            conn.rollback()
            return recovery
        key = _key(after)
        begun = self._state_at(after)
        scan = _Scan(begun, key, key)
        buffer: _Buffer | None = None
        to_end, more = False, False
        if self._owed:
            self._owed = False
            self._emit(scan, limit)
        for _ in range(_MAX_ROUNDS):
            if len(scan.rows) >= limit:
                break
            want = limit - len(scan.rows)
            buffer, start = self._buffered(conn, scan.position, want)
            picked = buffer.changes[start : start + want]
            streamed = len(scan.rows)
            self._scan(conn, scan, picked)
            to_end = start + len(picked) == len(buffer.changes)
            if len(scan.rows) >= limit or not (buffer.exhausted and to_end):
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
        conn.rollback()  # no snapshot held between pages
        advance = self._advance(scan, begun)
        if buffer is not None:
            self._hint(buffer, scan, to_end, advance)
        return Page(scan.rows, advance=advance, more=more and len(scan.rows) < limit)

    def _advance(self, scan: _Scan, begun: SnapshotState | None) -> Position | None:
        """Where the checkpoint must go when the snapshot's state moved and no row carries it.

        A request, a cancel, a chunk with no row left: the position of the last change read
        (everything up to it is handled), with the new state; the tick writes it even with no
        row to send, so the change reaches the state blob in the same tick.
        """
        if scan.state == begun or (scan.rows and scan.rows[-1].position.snapshot == scan.state):
            return None
        lsn, seq = scan.position or (0, 0)  # nothing read yet: before the whole log
        return Position(Lsn(lsn), {"seq": seq}, scan.state)

    def _buffered(self, conn: sa.Connection, after: tuple[int, int] | None, limit: int) -> tuple[_Buffer, int]:
        """This tick's decoded changes, and where those after ``after`` start in them (peeks as needed).

        A buffer read to the end of the log is still whole while the log's flush position has
        not moved since its peek (a peek decodes only flushed WAL): then no peek is needed, which
        keeps a tick that pages a snapshot chunk out of memory from reading the slot for nothing.
        """
        buffer: _Buffer | None = self._local.buffer if getattr(self._local, "pinning", False) else None
        if buffer is None or len(buffer.changes) - _after(buffer, after) < limit:
            spooled = self._spooled(conn, after, limit)
            if spooled is not None:
                if getattr(self._local, "pinning", False):
                    self._local.buffer = spooled
                return spooled, _after(spooled, after)
            flushed = Lsn.parse(conn.execute(_FLUSH).scalar_one())  # before the peek: see _Buffer.flushed
            if buffer is not None and buffer.exhausted and flushed == buffer.flushed:
                return buffer, _after(buffer, after)
            # Not enough decoded: peek again. The slot starts at its confirmed position, which may
            # be behind ``after`` (the changes up to it are skipped), so read more until enough.
            n = max(_MIN_PEEK, (buffer.messages if buffer else 0) + _MESSAGES_PER_CHANGE * limit * _PAGES_PER_PEEK)
            while True:
                buffer = self._peek(conn, n, after, max(limit, self.MAX_DECODED), flushed)
                if buffer.exhausted or len(buffer.changes) >= limit or self._spool is not None:
                    break  # (a spool: the next round reads on from it, not from the slot)
                n *= _PAGES_PER_PEEK
                flushed = Lsn.parse(conn.execute(_FLUSH).scalar_one())
            if getattr(self._local, "pinning", False):
                self._local.buffer = buffer
        return buffer, _after(buffer, after)

    def _scan(self, conn: sa.Connection, scan: _Scan, picked: list[Change]) -> None:
        """Walk ``picked`` in log order: rows, snapshot requests, the chunks' windows and watermarks."""
        for c in picked:
            chunk = self._chunk
            if chunk is not None and not chunk.covers(scan.state, scan.position):
                chunk = self._chunk = None  # read for another state, or the log was not read contiguously
            ahead = self._ahead
            if ahead is not None and not ahead.covers(scan.position):
                ahead = self._ahead = None  # the same for the chunk read ahead
            scan.last, scan.position = c, c.key
            if c.relation.qualified == self._signal:
                self._signal_read(scan, c, chunk, ahead)
                continue
            table = c.relation.qualified
            ahead_table = ahead.basis.tables[0] if ahead is not None else None
            keys = self._keys(conn, c) if table in (chunk.table if chunk else None, ahead_table) else []
            if chunk is not None:
                chunk.saw(c.key, table, keys if table == chunk.table else ())
            if ahead is not None:
                ahead.scanned_to = c.key
                if table == ahead_table:
                    ahead.seen.append((c.key, table, keys))
            scan.rows.append(self._row(conn, c, scan.state))
            scan.streamed += 1

    def _signal_read(self, scan: _Scan, c: Change, chunk: Chunk | None, ahead: _Ahead | None) -> None:
        """A change of the signal table: a request of ours, a chunk's high watermark, or nothing of ours."""
        if chunk is not None:
            chunk.saw(c.key, None, ())
        if ahead is not None:
            ahead.scanned_to = c.key
        signal = signal_of(c.new, self._config.name)
        if signal is None:
            return
        kind, signal_id, data = signal
        if kind == KIND_REQUEST:
            self._request(scan, c, signal_id, data)
        elif kind == KIND_WATERMARK and chunk is not None and chunk.id == signal_id:
            # The high watermark: every change the select could have missed is behind us; the
            # chunk's rows go once the log is read to its end (_emit).
            chunk.ready_at = _commit_time(c)
        elif kind == KIND_WATERMARK and ahead is not None and ahead.chunk_id == signal_id:
            ahead.ready_at = _commit_time(c)

    def _request(self, scan: _Scan, c: Change, signal_id: str, data: dict[str, Any]) -> None:
        """A ``dbfanout snapshot`` request read from the log: the snapshot state changes here."""
        if scan.state is not None and signal_id == scan.state.id:
            # A request row written by hand with the last run's id: the run's event ids must
            # differ from that run's, or a repair would be absorbed as duplicates (its log
            # position is the same whenever this request is read again).
            signal_id = f"{signal_id}@{c.commit_lsn}"
        at = _commit_time(c)
        state, warning = apply_request(self._config, scan.state, data, signal_id, at)
        if warning:
            self._warn_once(f"request-{signal_id}", "%s", warning)
        if state is not None and state.active and state.where is not None:
            try:  # a condition is checked before anything of it runs (a request may come from anyone)
                self._chunks.check_where(state.tables, state.where)
            except WhereRefused as exc:
                log.error("poller %s: snapshot %s refused: where %s", self._config.name, signal_id, exc,
                          extra=ids(poller=self._config.name))  # fmt: skip
                state = replace(state, tables=(), finished_at=at, error=f"where refused: {exc}")
        if state == scan.state:
            return
        if state is not None and state.active and state.estimate is None:
            if state.id not in self._estimates:
                self._estimates[state.id] = self._chunks.estimate(state.tables)
            state = replace(state, estimate=self._estimates[state.id])
        log.info("poller %s: snapshot %s %s at %s", self._config.name, signal_id,
                 "cancelled" if state is not None and state.cancelled else "requested", c.commit_lsn,
                 extra=ids(poller=self._config.name))  # fmt: skip
        scan.state, self._chunk = state, None

    def _state_at(self, after: Position | None) -> SnapshotState | None:
        """The snapshot state a fetch starts with: the checkpoint's, or the initial one on a first start."""
        if after is not None:
            return after.snapshot
        if self._config.snapshot != "initial":
            return None
        if self._initial is None:  # one per process: a chunk read for it stays valid across fetches
            tables = [qualified(t) for t in self._config.tables]
            self._initial = initial_state(self._config, dt.datetime.now(dt.UTC), self._chunks.estimate(tables))
        return self._initial

    def _wants_chunk(self, scan: _Scan) -> bool:
        """Whether a snapshot is running with no chunk in flight for where the scan stands."""
        state = scan.state
        if state is None or not state.active:
            return False
        return self._chunk is None or not self._chunk.covers(state, scan.position)

    def _begin_chunk(self, conn: sa.Connection, scan: _Scan) -> bool:
        """Read the next chunk (and write its high watermark) when a snapshot runs and none is in flight.

        Tables (or their rest) with no row left are passed at once; the scan's state moves on.
        False when a chunk was due but had to wait (a commit its select could not see yet).
        """
        while self._wants_chunk(scan):
            state = scan.state
            assert state is not None
            self._chunks.check_published()
            ahead = self._take_ahead(scan)
            if ahead is not None:
                if ahead.tuples:
                    self._chunk = ahead  # its watermark: read already, or in the log after the last peek
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
                self._local.buffer = None  # the next peek must read past the watermark just written
                return True
            scan.state = chunk.advanced(dt.datetime.now(dt.UTC))
        return True

    def _read_chunk(
        self, conn: sa.Connection, state: SnapshotState, start: tuple[int, int] | None
    ) -> tuple[Chunk | None, SnapshotState]:
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
                chunk = self._chunks.read(conn, basis, start, limit=limit)
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

    def _read_ahead(self, chunk: Chunk, position: tuple[int, int] | None) -> None:
        """Start reading the chunk after ``chunk`` on the read-ahead thread, its window opening at
        ``position`` (the log is read to there, and the select begins later)."""
        basis = chunk.next_basis()
        if basis is None:
            return
        if self._reader is None:
            self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"snapshot-{self._config.name}")
        chunk_id = uuid.uuid4().hex
        limit = self._limits.get(basis.id)
        future = self._reader.submit(self._chunks.read_ahead, basis, position, chunk_id, limit)
        self._ahead = _Ahead(future, basis, chunk_id, position, position)

    def _take_ahead(self, scan: _Scan) -> Chunk | None:
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

    def _emit(self, scan: _Scan, room: int) -> bool:
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
                     scan.last.commit_lsn if scan.last else None, len(chunk.dropped),
                     extra=ids(poller=self._config.name))  # fmt: skip
        return len(taken) >= room

    def _chunk_rows(
        self, chunk: Chunk, taken: Sequence[Any], at: tuple[int, int] | None, state: SnapshotState
    ) -> list[SourceRow]:
        """Chunk rows as ``read`` events at log position ``at``."""
        lsn, seq = at or (0, 0)
        position = Position(Lsn(lsn), {"seq": seq}, state)
        cursor = (Lsn(lsn), seq)
        names, table, prefix = chunk.names, chunk.table, f"read/{state.id}/{chunk.table}/"
        # Positional arguments: a chunk is thousands of rows, built here one by one. The version
        # (snapshot run, table and xmin) is what a re-read of the same row version within one run
        # gets the same event id from; another run's read of it is a new event (a repair delivers).
        # zip stops at the names: the xmin (and a flag) after them are not columns of the row.
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

    def _keys(self, conn: sa.Connection, c: Change) -> list[tuple[Any, ...]]:
        """The primary keys a change touches (an update that changes the key: both)."""
        pk = self._pk(conn, c.relation)
        return [tuple(image[p] for p in pk) for image in (c.new, c.old) if image and all(p in image for p in pk)]

    def _hint(self, buffer: _Buffer, scan: _Scan, to_end: bool, advance: Position | None) -> None:
        """Remember how far the slot may go once the page's end position is a landed checkpoint.

        Past the whole transaction when the page ends with its last change; to the log position
        the peek read to when nothing relevant follows (so an idle slot does not hold WAL back).
        A snapshot state change no row carries ends the page too (its ``advance``), so the slot
        never passes a request or a watermark before a checkpoint has its new state.
        """
        if not getattr(self._local, "pinning", False):
            return
        hints = self._hints
        key = _key(advance) if advance is not None else _key(scan.rows[-1].position) if scan.rows else scan.after
        if key is None:
            return
        last = scan.last
        target = Lsn(key[0]) if last is None else last.end_lsn if last.last_in_txn else last.commit_lsn
        if buffer.exhausted and to_end and (last is None or last.last_in_txn):
            target = Lsn(max(target, buffer.flushed))
        hints[key] = Lsn(max(target, hints.get(key, 0)))

    def _peek(self, conn: sa.Connection, n: int, after: tuple[int, int] | None, keep: int, flushed: Lsn) -> _Buffer:
        """Up to ``n`` messages from the slot's position; the changes after ``after``, decoded.

        ``flushed``: the log's flush position, read before this peek in the same transaction.

        Streamed, and no more than about ``keep`` changes are decoded: the server returns a
        transaction whole however large it is, and a bulk load of a million rows must not be held
        in memory. When the peek stops inside a transaction (larger than ``keep``), it reads on to
        that transaction's Commit into a spool (:mod:`poller.pg_spool`) instead of cancelling:
        the next pages are decoded from there, and the server decodes the transaction once, not
        once per peek (issue 33). The raw messages are held until then (at most
        :data:`_SPOOL_AFTER_BYTES`, spooled as they come past that), so the spool starts where
        the peek did (the slot's position) and covers any position a later fetch starts from.
        """
        decoder = Decoder(_loader(conn), skip_through=after)
        changes: list[Change] = []
        read, stopped = 0, False
        tape = _Tape()
        try:
            with closing(_stream(conn, _PEEK_SQL, {"slot": self._slot, "n": n, "pub": self._publication})) as rows:
                for data in rows:
                    read += 1
                    tape.write(data)
                    changes.extend(c for c in decoder.feed(data) if self._wanted(c))
                    if len(changes) + decoder.pending >= keep:
                        stopped = True
                        changes.extend(c for c in decoder.partial() if self._wanted(c))
                        break
                if stopped and decoder.in_transaction:
                    self._spool_rest(tape.spool(), rows, changes)
        finally:
            tape.close()  # what was not kept
        return _Buffer(changes, [c.key for c in changes], not stopped and read < n, flushed, read)

    def _spool_rest(self, spool: Spool, rows: Iterator[bytes], changes: list[Change]) -> None:
        """Read the rest of the transaction the peek stopped in into ``spool``; keep it when its
        Commit came (and give the changes decoded of it their end LSN)."""
        for data in rows:
            spool.write(data)
            if not spool.in_transaction:
                break
        if spool.in_transaction:  # the peek ended before the Commit: never expected; peek again instead
            return
        spool.finish()
        last = spool.last_key
        if last is None or spool.end_lsn is None:
            return
        for c in changes:
            if c.commit_lsn == last[0]:
                c.end_lsn, c.last_in_txn = spool.end_lsn, c.key == last
        if changes and changes[-1].key == last:  # the peek stopped at its last change
            spool.ours_until = last
        self._drop_spool()
        self._spool = spool
        log.info("poller %s: a transaction of %d+ changes at %s is read once into a local spool (%d bytes); "
                 "pages come from it until the slot is past it", self._config.name, last[1] + 1, Lsn(last[0]),
                 spool.size, extra=ids(poller=self._config.name))  # fmt: skip

    def _spooled(self, conn: sa.Connection, after: tuple[int, int] | None, limit: int) -> _Buffer | None:
        """The changes after ``after`` from the spool, when it holds them (None: peek).

        Once its last change was read (``after`` is it), nothing until the slot is past it (a
        landed checkpoint there, acknowledged): a peek would decode the whole transaction again.
        The page ends there; the slot moves at the tick's end and the next tick peeks past it.
        """
        spool = self._spool
        if spool is None:
            return None
        if spool.delivered_by(after) and spool.end_lsn is not None:
            return _Buffer([], [], True, spool.end_lsn, 0)  # "read to its end": see _hint
        if spool.covers(after):
            keep, changes, end = max(limit, self.MAX_DECODED), [], False
            with closing(spool.changes(after, _loader(conn))) as found:
                for c in found:
                    end = c.key == spool.last_key
                    if self._wanted(c):
                        changes.append(c)
                        if len(changes) >= keep:
                            break
            if end:  # a checkpoint here covers all of it that is ours (its tail may not be)
                spool.ours_until = changes[-1].key if changes else after
            return _Buffer(changes, [c.key for c in changes], False, Lsn(0), 0)
        self._drop_spool()  # passed (another process delivered it): read the slot again
        return None

    def _drop_spool(self) -> None:
        spool, self._spool = self._spool, None
        if spool is not None:
            spool.close()

    def _wanted(self, change: Change) -> bool:
        if change.kind == "truncate":
            names = ", ".join(r.qualified for r in change.truncated)
            self._warn_once(f"truncate-{change.commit_lsn}", "TRUNCATE of %s at %s is not delivered (a truncate "
                            "has no rows; publish 'insert, update, delete')", names, change.commit_lsn)  # fmt: skip
            return False
        if change.relation.qualified == self._signal:  # ours only: other pollers share the table
            return signal_of(change.new, self._config.name) is not None
        return _listed(change.relation, self._config.tables)

    def _row(self, conn: sa.Connection, c: Change, state: SnapshotState | None) -> SourceRow:
        pk_cols = self._pk(conn, c.relation)
        deleted = c.kind == "delete"
        image = c.old if deleted else c.new
        assert image is not None or deleted
        source = image or {}
        missing = [p for p in pk_cols if p not in source]
        if missing:
            raise SourceError(
                f"poller {self._config.name}: {c.kind} on {c.relation.qualified} at {c.commit_lsn} lacks key "
                f"column(s) {missing}",
                hint=f"give {c.relation.qualified} a primary key (or REPLICA IDENTITY FULL), or set pk to its key",
            )
        before = c.old
        if c.kind == "update" and c.old_is_key and c.old is not None:
            before = {p: c.old[p] for p in pk_cols if p in c.old}  # the key changed: the old key
        fields = EventFields(
            pk={p: source[p] for p in pk_cols},
            cursor=(c.commit_lsn, c.seq),
            change=c.kind,
            before=before,
            table=c.relation.qualified,
            committed_at=c.commit_time,
        )
        # A delete has no new row: no values (the event's after is null; its old image is before).
        return SourceRow(Position(c.commit_lsn, {"seq": c.seq}, state), dict(c.new or {}), deleted, fields)

    def _pk(self, conn: sa.Connection, rel: Relation) -> tuple[str, ...]:
        if self._config.pk:
            return self._config.pk
        pk = self._pks.get(rel.oid)
        if pk is None:
            pk = tuple(conn.execute(_PRIMARY_KEY, {"oid": rel.oid}).scalars())
            if not pk and rel.replica_identity in ("d", "i"):
                pk = rel.key_columns  # a REPLICA IDENTITY USING INDEX key
            if not pk:
                raise SourceError(
                    f"poller {self._config.name}: table {rel.qualified} has no primary key",
                    hint="add a primary key, or set pk to the columns that identify a row",
                )
            self._pks[rel.oid] = pk
        return pk

    def _recheck(self, after: Position | None) -> Page | None:
        """The slot check after a failed read (raises when the slot is lost; None when the server
        itself cannot be reached: the read's own error says so)."""
        try:
            with self._connection("slot check") as conn:
                return self._guard.check(conn, after, force=True)
        except PositionLostError:
            raise
        except SourceError:
            return None

    def _forget_log(self) -> None:
        """The slot was replaced: what was read of the old one (buffer, chunks, hints) is void."""
        self._local.buffer, self._chunk, self._ahead, self._owed = None, None, None, False
        self._hints.clear()

    # ------------------------------------------------------------------------------ plumbing

    @contextmanager
    def _connection(self, op: str) -> Iterator[sa.Connection]:
        with self._db_errors(op):
            if not getattr(self._local, "pinning", False):
                with self._engine.connect() as conn:
                    yield conn
                return
            conn = self._local.conn
            if conn is None:
                conn = self._local.conn = self._engine.connect()
            try:
                yield conn
            except BaseException:
                with suppress(sa.exc.SQLAlchemyError):
                    conn.rollback()
                raise

    def _warn_once(self, key: str, message: str, *args: Any) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning("poller %s: " + message, self._config.name, *args, extra=ids(poller=self._config.name))

    def _db_errors(self, op: str) -> AbstractContextManager[None]:
        return db_errors(f"poller {self._config.name}: {op} from slot {self._slot} at {self._url}",
                         self._config.source_url)  # fmt: skip


def _key(position: Position | None) -> tuple[int, int] | None:
    if position is None:
        return None
    seq = position.pk.get("seq")
    if not isinstance(position.cursor, int) or not isinstance(seq, int):
        raise SourceError(
            f"the checkpoint {position.cursor!r}/{dict(position.pk)} is not a pg_lsn position",
            hint="this checkpoint was written by another source kind: `dbfanout checkpoint reset` the poller",
        )
    return (int(position.cursor), seq)


def _sqlstate(error: BaseException) -> str | None:
    """The SQLSTATE of the server's answer behind ``error`` (None: no answer, e.g. a lost connection)."""
    cause = error.__cause__
    return getattr(getattr(cause, "orig", cause), "sqlstate", None)


def _commit_time(c: Change) -> dt.datetime:
    return _PG_EPOCH + dt.timedelta(microseconds=c.commit_time_us)


def _after(buffer: _Buffer, key: tuple[int, int] | None) -> int:
    return 0 if key is None else bisect.bisect_right(buffer.keys, key)


def _listed(rel: Relation, tables: Sequence[str]) -> bool:
    return any(t == rel.qualified or (t == rel.name and rel.schema == "public") for t in tables)


def _stream(conn: sa.Connection, query: str, params: dict[str, Any]) -> Generator[bytes, None, None]:
    """The first column of each row of ``query``, streamed by the driver itself (psycopg 3).

    One round trip, rows read off the socket in parts of :data:`_STREAM_ROWS` (single rows with a
    libpq older than 17), not held whole: SQLAlchemy's ``stream_results`` would declare a server
    cursor (three more round trips, a peek's largest cost). Stopping early cancels the rest.
    Runs in the transaction ``conn`` has begun; driver errors reach the caller as SQLAlchemy's.
    A stop that cancelled the statement may have aborted that transaction (a race with the
    server's end of the query): it is rolled back then, so the connection's next statement runs.
    """
    import psycopg  # an optional driver: see _loader

    driver: psycopg.Connection[Any] = conn.connection.driver_connection  # type: ignore[assignment]
    size = _STREAM_ROWS if psycopg.pq.version() >= 170000 else 1
    cursor = driver.cursor(binary=True)
    try:
        for row in cursor.stream(query, params, size=size):
            yield row[0]
    except psycopg.Error as exc:
        broken = driver.broken
        if broken:
            conn.invalidate(exc)
        raise sa.exc.DBAPIError.instance(query, params, exc, psycopg.Error, connection_invalidated=broken) from exc
    finally:
        cursor.close()
        if not driver.broken and driver.info.transaction_status == psycopg.pq.TransactionStatus.INERROR:
            conn.rollback()  # "current transaction is aborted" otherwise, on every tick (issue 33)


def _loader(conn: sa.Connection) -> Any:
    """Text → Python with psycopg's own loaders: the same types a keyset fetch returns."""
    # Imported here, not at module level: psycopg is an optional driver (requirements-drivers.txt),
    # and apps whose pollers are keyset or outbox on another database never install it.
    from psycopg.adapt import Transformer
    from psycopg.pq import Format

    driver = conn.connection.driver_connection
    tx = Transformer(driver)
    loaders: dict[int, Any] = {}

    def load(oid: int, data: bytes) -> Any:
        loader = loaders.get(oid)
        if loader is None:
            loader = loaders[oid] = tx.get_loader(oid, Format.TEXT)
        return loader.load(data)

    return load

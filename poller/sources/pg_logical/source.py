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
   come from (:mod:`poller.sources.pg_logical.spool`), until the slot is past it.
2. the tick sends the page (event ids from the position: duplicate detection drops re-sends);
3. the tick commits the checkpoint (CAS, fencing);
4. only then ``acknowledge`` advances the slot to what the landed checkpoint covers (and, while
   the poller's tables are quiet, past the log read, from the first tick on:
   :mod:`poller.sources.pg_logical.advance`).

What the slot sends that no row carries — a TRUNCATE, a change of a relation not in ``tables`` —
is never dropped in silence (:mod:`poller.sources.pg_logical.relations`); the publication's DDL is
:mod:`poller.sources.pg_logical.publication`'s.

A crash anywhere re-reads from the slot, which may be behind the checkpoint: changes at or
before the checkpoint are skipped. The slot and the publication are created by
``dbfanout validate --fix`` (or :func:`setup_sql`), never at tick time.

Snapshots (``snapshot = "initial"``, ``dbfanout snapshot``) run inside the same fetches: the rows
that already exist are read in chunks beside the stream, emitted from their high watermark's log
position on, with DBLog's rule that a key the log changed meanwhile leaves the chunk (see
:mod:`poller.snapshot.chunks`). The snapshot is the coordinator's
(:class:`~poller.snapshot.coordinator.SnapshotCoordinator`); this source is the
:class:`~poller.snapshot.contracts.LogReader` it walks (its position keys are ``(commit LSN,
seq)``) and reads the slot through :mod:`poller.sources.pg_logical.peek`.
"""

from __future__ import annotations

import datetime as dt
import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, suppress
from typing import Any

import sqlalchemy as sa

from poller.ports import EventFields, Page, SourceRow
from poller.snapshot.chunks import qualified
from poller.snapshot.contracts import ChunkSource, LogRead, Signal
from poller.snapshot.coordinator import SnapshotCoordinator
from poller.snapshot.postgres import ChunkReader, signal_sql
from poller.snapshot.requests import signal_of
from poller.sources.engines import db_errors, require_driver, source_engine
from poller.sources.pg_logical.advance import SlotAdvancer, position_key, slot_status
from poller.sources.pg_logical.ahead import TickBuffer
from poller.sources.pg_logical.peek import Buffer, SlotReader
from poller.sources.pg_logical.pgoutput import Change, Relation
from poller.sources.pg_logical.publication import VIA_ROOT_SINCE, create_publication_sql, create_slot_sql
from poller.sources.pg_logical.relations import Relations
from poller.sources.pg_logical.slot import SlotGuard
from shared.config import PollerConfig
from shared.errors import ConfigError, PositionLostError, SourceError
from shared.ids import source_fingerprint
from shared.logs import get_logger, ids
from shared.models import Checkpoint, CursorValue, Lsn, Position, SnapshotState
from shared.settings import fingerprint_url, redact_url

__all__ = ["PgLogicalSource", "setup_sql"]

log = get_logger("poller.pg_logical")

_PRIMARY_KEY = sa.text(
    "SELECT a.attname FROM pg_index i CROSS JOIN LATERAL unnest(i.indkey) WITH ORDINALITY AS k(attnum, n)"
    " JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum"
    " WHERE i.indrelid = :oid AND i.indisprimary ORDER BY k.n"
)


def setup_sql(config: PollerConfig, version: int = VIA_ROOT_SINCE) -> list[str]:
    """The statements that create the signal table, the publication, then the slot (that order: see the docs).

    The publication holds the poller's tables and the snapshot signal table (poller.snapshot.chunks):
    a snapshot's watermarks and requests reach the poller through the slot. ``version``: the
    server's ``server_version_num`` (see :mod:`poller.sources.pg_logical.publication`).
    """
    return [*signal_sql(config), create_publication_sql(config, version), create_slot_sql(config)]


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
        self._fixed_pk = config.pk or None  # the configured key, for every table
        self._commit_time: tuple[int, dt.datetime | None] = (-1, None)  # the last change's (see row)
        self._signal = config.signal_table
        chunks = ChunkReader(config, self._engine)
        self._snapshots: SnapshotCoordinator[Change] = SnapshotCoordinator(config, self, chunks)
        self._guard = SlotGuard(config, self._engine, self._url, chunks.estimate, self._forget_log)
        self._local = threading.local()  # pinned connection and last read, per thread
        self._tick = TickBuffer()  # this tick's decoded changes, shared by the threads reading it (ahead.py)
        # The last checkpoint that landed, and the last the slot was moved to within a tick (see _landed_first).
        self._landed_key: tuple[int, int] | None = None
        self._advanced_key: tuple[int, int] | None = None
        self._warned: set[str] = set()
        self._relations = Relations(config, self._warn_once)  # what is kept; unknown relations, truncates
        # Peeks, and a transaction larger than MAX_DECODED read once into a spool (poller.sources.pg_logical.spool).
        self._slot_reader = SlotReader(config, self._relations.wanted)
        self._advancer = SlotAdvancer(config, self._slot_reader, self._connection)

    # ------------------------------------------------------------------------------ the port

    @property
    def fingerprint(self) -> str:
        return self._fingerprint

    @property
    def prefetch_pages(self) -> bool:
        """The tick may peek and decode the next pages while it sends these (poller.tick.prefetch):
        a read moves nothing; the slot follows landed checkpoints only (see poller.sources.pg_logical.ahead)."""
        return True

    def reads_on(self, page: Page) -> bool:
        """Whether the page after ``page`` may be read ahead: not while a snapshot runs (its chunk
        reads write watermarks; they keep the timing a tick reading in turn gives them)."""
        end = page.end
        return end is None or end.snapshot is None or not end.snapshot.active

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
        self._local.pinning, self._local.conn = True, None
        if self._tick.enter():  # the tick's own pin; a reader thread's goes on from the tick's buffer
            self._guard.new_tick()
        try:
            yield
        finally:
            conn = self._local.conn
            self._local.pinning, self._local.conn = False, None
            self._tick.leave()
            if conn is not None:
                with suppress(sa.exc.SQLAlchemyError):
                    conn.close()

    def acknowledge(self, checkpoint: Checkpoint) -> None:
        """Advance the slot to what ``checkpoint`` (a landed write) covers; never past it (see
        :mod:`poller.sources.pg_logical.advance`: with no position yet, past a quiet log)."""
        key = _key(checkpoint.position)
        self._relations.landed(key)
        self._advancer.advance(key)

    def landed(self, checkpoint: Checkpoint) -> None:
        """A checkpoint write landed (the tick's committer thread): the next peek of this tick may
        move the slot to it first (:meth:`_landed_first`); not while a snapshot runs (its chunks
        are read in the fetch's transaction: the tick's end moves the slot then)."""
        position = checkpoint.position
        active = position is not None and position.snapshot is not None and position.snapshot.active
        self._landed_key = None if active else _key(position)

    def close(self) -> None:
        """Stop the read-ahead thread; the engine is shared per URL
        (see :func:`poller.sources.engines.dispose_engines`)."""
        self._snapshots.close()
        self._slot_reader.drop_spool()

    def forget(self) -> None:
        """The lease went to another process: drop the spool (it delivers the transaction meanwhile,
        and a later fetch here reads the slot again from the checkpoint it finds)."""
        self._slot_reader.drop_spool()

    @property
    def spool_bytes(self) -> int:
        """Bytes of the local spool of a huge transaction (0: none)."""
        spool = self._slot_reader.spool
        return spool.size if spool is not None else 0

    # ------------------------------------------------------------------------------ operator surface

    @property
    def slot(self) -> str:
        return self._slot

    def slot_status(self) -> dict[str, Any] | None:
        """The slot as ``pg_replication_slots`` shows it (None when it does not exist)."""
        with self._connection("slot status") as conn:
            status = slot_status(conn, self._slot, self._publication)
            conn.rollback()
        return status

    @property
    def _chunks(self) -> ChunkSource:
        """The snapshot's chunk reader (the coordinator's; tests put a reader of their own here)."""
        return self._snapshots.chunks

    @_chunks.setter
    def _chunks(self, chunks: ChunkSource) -> None:
        self._snapshots.chunks = chunks

    # ------------------------------------------------------------------------------ reading

    def _fetch(self, conn: sa.Connection, after: Position | None, limit: int) -> Page:
        """The slot's check, then the coordinator's page (the stream, and a snapshot's chunks beside it)."""
        recovery = self._guard.check(conn, after)  # the slot lost: an error, or (opt-in) a resnapshot
        if recovery is not None:
            conn.rollback()
            return recovery
        self._local.read = None
        fetched = self._snapshots.fetch(conn, after, limit)
        conn.rollback()  # no snapshot held between pages
        read: tuple[Buffer, bool] | None = self._local.read
        at_end = read is not None and read[0].exhausted and read[1]
        state = self._snapshots.state_at(after)  # the state the fetch began with
        self._relations.attach(fetched.page, fetched.after, state, at_end)  # a TRUNCATE is never passed silently
        if read is not None and getattr(self._local, "pinning", False):
            self._advancer.hint(read[0], fetched, read[1])
        page = fetched.page
        if read is not None and read[0].spool_end and len(page):
            # Short at a spool's end, not at the log's: once its checkpoint landed, the next fetch
            # moves the slot past the spool and peeks on (_landed_first); the tick goes on.
            page.more = True
        return page

    # ------------------------------------------------------------------------------ the coordinator's log reader

    @property
    def signal_table(self) -> str:
        return self._signal

    def qualify(self, table: str) -> str:
        return qualified(table)

    def key_of(self, position: Position | None) -> tuple[int, int] | None:
        return _key(position)

    def changes(self, conn: sa.Connection, after: tuple[int, int] | None, want: int) -> LogRead[Change]:
        """Up to ``want`` changes after ``after``: from this tick's buffer, the spool, or a peek."""
        pinning = getattr(self._local, "pinning", False)
        buffer, start = self._slot_reader.read(
            conn, after, want, self._tick.buffer if pinning else None, self.MAX_DECODED, self._landed_first
        )
        if pinning:
            self._tick.buffer = buffer
        picked = buffer.changes[start : start + want]
        to_end = start + len(picked) == len(buffer.changes)
        self._local.read = (buffer, to_end)  # the last read of the fetch: see _hint
        return LogRead(picked, buffer.exhausted and to_end)

    def _landed_first(self, conn: sa.Connection) -> None:
        """Before a peek within a tick: the slot moves to the last landed checkpoint, so the peek does
        not decode again what the tick sent already. With a spool, only once a landed checkpoint covers
        all of it: the slot goes past it and it is dropped, so the tick peeks on after its end
        rather than stopping there as if caught up."""
        key = self._landed_key
        if key is None or not getattr(self._local, "pinning", False):
            return
        spool = self._slot_reader.spool
        if spool is not None:
            if spool.end_lsn is None or not spool.passed_by(key):
                return  # a peek would decode it again: its pages come from the spool meanwhile
            self._advancer.advance_within(conn, key, spool.end_lsn)
            self._slot_reader.drop_spool()
            self._advanced_key = key
            return
        if self._advanced_key is not None and key <= self._advanced_key:
            return
        self._advancer.advance_within(conn, key)
        self._advanced_key = key

    def reread(self) -> None:
        self._tick.buffer = None

    def signal(self, change: Change) -> Signal | None:
        return signal_of(change.new, self._config.name)

    def committed_at(self, change: Change) -> dt.datetime:
        return change.commit_time

    def keys(self, conn: sa.Connection, c: Change) -> list[tuple[Any, ...]]:
        """The primary keys a change touches (an update that changes the key: both)."""
        pk = self._pk(conn, c.relation)
        return [tuple(image[p] for p in pk) for image in (c.new, c.old) if image and all(p in image for p in pk)]

    def position(self, key: tuple[int, int] | None, state: SnapshotState | None) -> Position:
        lsn, seq = key or (0, 0)  # before the whole log: 0/0
        return Position(Lsn(lsn), {"seq": seq}, state)

    def cursor(self, key: tuple[int, int] | None) -> CursorValue:
        lsn, seq = key or (0, 0)
        return (Lsn(lsn), seq)

    def describe(self, key: tuple[int, int]) -> str:
        return str(Lsn(key[0]))

    def row(self, conn: sa.Connection, c: Change, state: SnapshotState | None) -> SourceRow:
        rel, kind = c.relation, c.kind
        pk_cols = self._fixed_pk or self._pks.get(rel.oid) or self._pk(conn, rel)
        deleted = kind == "delete"
        image = c.old if deleted else c.new
        assert image is not None or deleted
        try:
            pk = {p: image[p] for p in pk_cols}  # type: ignore[index]  # None: below
        except (KeyError, TypeError):
            missing = [p for p in pk_cols if p not in (image or {})]
            raise SourceError(
                f"poller {self._config.name}: {kind} on {rel.qualified} at {c.commit_lsn} lacks key "
                f"column(s) {missing}",
                hint=f"give {rel.qualified} a primary key (or REPLICA IDENTITY FULL), or set pk to its key",
            ) from None
        before = c.old
        if before is not None and c.old_is_key and kind == "update":
            before = {p: before[p] for p in pk_cols if p in before}  # the key changed: the old key
        at_us, at = self._commit_time
        if at_us != c.commit_time_us:  # a transaction's changes share it: made once for all of them
            at = c.commit_time
            self._commit_time = (c.commit_time_us, at)
        fields = EventFields(
            pk=pk, cursor=(c.commit_lsn, c.seq), change=kind, before=before, table=rel.qualified, committed_at=at
        )
        # A delete has no new row: no values (the event's after is null; its old image is before). The
        # change's own dict is shared, not copied: neither the row nor the change is changed later.
        new = c.new
        return SourceRow(Position(c.commit_lsn, {"seq": c.seq}, state), new if new is not None else {}, deleted, fields)

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
        self._tick.buffer = None
        self._snapshots.forget()
        self._advancer.clear()

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


_key = position_key


def _sqlstate(error: BaseException) -> str | None:
    """The SQLSTATE of the server's answer behind ``error`` (None: no answer, e.g. a lost connection)."""
    cause = error.__cause__
    return getattr(getattr(cause, "orig", cause), "sqlstate", None)

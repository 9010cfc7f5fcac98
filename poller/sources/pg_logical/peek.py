"""Reading a replication slot for the pg_logical source: peeks, their decoded buffer, and the spool.

Why its own module: how changes come off the slot (a peek streamed and decoded as it comes, a
huge transaction spooled once, a tick's buffer reused while the log has not grown) is one job;
what the source makes of them (rows, snapshots, checkpoints, the slot's advance) is another.

A peek (``pg_logical_slot_peek_binary_changes``) reads without consuming, from the slot's
confirmed position; the changes at or before the fetch position are skipped as they decode. A
transaction larger than a peek's cap (a quarter more when others precede it) is read from the
slot once into a local spool (:mod:`poller.sources.pg_logical.spool`); the next pages come from it
until the slot is past it.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Generator, Iterator
from contextlib import closing
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from poller.sources.pg_logical.pgoutput import Change, Decoder, TypeLoaders
from poller.sources.pg_logical.spool import Spool
from poller.sources.pg_logical.values import as_text, base_type
from shared.config import PollerConfig
from shared.logs import get_logger, ids
from shared.models import Lsn

__all__ = ["Buffer", "SlotReader", "after_index"]

log = get_logger("poller.pg_logical")

_PEEK_SQL = (
    "SELECT data FROM pg_logical_slot_peek_binary_changes("
    "CAST(%(slot)s AS name), NULL, %(n)s, 'proto_version', '1', 'publication_names', %(pub)s)"
)
_FLUSH = sa.text("SELECT CAST(pg_current_wal_flush_lsn() AS text)")
_MIN_PEEK = 1024  # messages per peek at least
_MESSAGES_PER_CHANGE = 3  # a change is one message; a one-change transaction adds Begin and Commit
_PAGES_PER_PEEK = 4  # a peek decodes about this many pages (a tick's next pages come from its buffer)
_STREAM_ROWS = 1000  # messages fetched per round trip while streaming a peek
#: A peek whose cap falls inside a transaction decodes up to ``keep // _SLACK`` more changes to reach
#: its Commit (memory: a peek holds 1.25 times its cap at most).
_SLACK = 4
#: A peek holds this many bytes of raw messages at most; past them it writes them to a spool as
#: it goes (kept only when it stops inside a transaction larger than the cap: see SlotReader._peek).
_SPOOL_AFTER_BYTES = 8 << 20


@dataclass(slots=True)
class Buffer:
    """The changes after a fetch position, decoded by this tick's last peek (the slot does not move within a tick)."""

    changes: list[Change]
    keys: list[tuple[int, int]]
    exhausted: bool  # the peek reached the end of the log
    flushed: Lsn  # the log's flush position before that peek
    messages: int  # how many the peek read (a re-peek reads past them again)
    spool_end: bool = False  # the spool's end, before the slot may pass it: the log goes on after it
    #: The fetch position it was decoded after: it holds no change at or before it (None: from the
    #: slot's position on). A fetch from an earlier position (a drain that goes on from a landed
    #: checkpoint behind pages the reader thread read ahead and the tick dropped) must peek again.
    since: tuple[int, int] | None = None

    def covers(self, after: tuple[int, int] | None) -> bool:
        """Whether every change after ``after`` that the log held at its peek is in it."""
        return self.since is None or (after is not None and after >= self.since)


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


class SlotReader:
    """The decoded changes of one slot after a position: peeked, or read from the spool.

    ``wanted``: which decoded changes the source keeps (its tables, its signal rows). Fetches are
    serial (one tick at a time): the spool is the only state kept between them.
    """

    def __init__(self, config: PollerConfig, wanted: Callable[[Change], bool]) -> None:
        self._config = config
        self._slot, self._publication = config.slot, config.publication
        self._wanted = wanted
        # A transaction larger than the source's cap, read once from the slot (poller.sources.pg_logical.spool):
        # pages come from it until the slot is past it.
        self._spool: Spool | None = None

    @property
    def spool(self) -> Spool | None:
        return self._spool

    def read(
        self,
        conn: sa.Connection,
        after: tuple[int, int] | None,
        limit: int,
        buffer: Buffer | None,
        keep: int,
        before_peek: Callable[[sa.Connection], None] = lambda _conn: None,
    ) -> tuple[Buffer, int]:
        """This tick's decoded changes, and where those after ``after`` start in them (peeks as needed).

        A buffer read to the end of the log is still whole while the log's flush position has
        not moved since its peek (a peek decodes only flushed WAL): then no peek is needed, which
        keeps a tick that pages a snapshot chunk out of memory from reading the slot for nothing.
        ``buffer``: the tick's last one (None: none kept); ``keep``: changes a peek decodes at most;
        ``before_peek``: run before the log is peeked (the source moves the slot to what landed),
        and at a spool's end (the source moves the slot past it, and drops it, once that landed).
        """
        if buffer is not None and not buffer.covers(after):
            buffer = None  # decoded after a later position: the changes between are not in it
        if buffer is None or len(buffer.changes) - after_index(buffer, after) < limit:
            spool = self._spool
            if spool is not None and spool.delivered_by(after):
                before_peek(conn)  # a landed checkpoint that covers the spool moves the slot past it (and drops it)
            spooled = self._spooled(conn, after, limit, keep)
            if spooled is not None:
                return spooled, after_index(spooled, after)
            before_peek(conn)
            flushed = Lsn.parse(conn.execute(_FLUSH).scalar_one())  # before the peek: see Buffer.flushed
            if buffer is not None and buffer.exhausted and flushed == buffer.flushed:
                return buffer, after_index(buffer, after)
            # Not enough decoded: peek again. The slot starts at its confirmed position, which may
            # be behind ``after`` (the changes up to it are skipped), so read more until enough.
            n = max(_MIN_PEEK, (buffer.messages if buffer else 0) + _MESSAGES_PER_CHANGE * limit * _PAGES_PER_PEEK)
            while True:
                buffer = self._peek(conn, n, after, max(limit, keep), flushed)
                if buffer.exhausted or len(buffer.changes) >= limit or self._spool is not None:
                    break  # (a spool: the next round reads on from it, not from the slot)
                n *= _PAGES_PER_PEEK
                flushed = Lsn.parse(conn.execute(_FLUSH).scalar_one())
        return buffer, after_index(buffer, after)

    def _peek(self, conn: sa.Connection, n: int, after: tuple[int, int] | None, keep: int, flushed: Lsn) -> Buffer:
        """Up to ``n`` messages from the slot's position; the changes after ``after``, decoded.

        ``flushed``: the log's flush position, read before this peek in the same transaction.

        Streamed, and no more than about ``keep`` changes are decoded: the server returns a
        transaction whole however large it is, and a bulk load of a million rows must not be held
        in memory. When the cap falls inside a transaction after others, the peek reads on to its
        Commit if it comes within ``keep // _SLACK`` more changes (an ordinary transaction: the
        buffer ends at its boundary). When it stops inside a larger transaction, it reads on to
        that transaction's Commit into a spool (:mod:`poller.sources.pg_logical.spool`) instead of cancelling:
        the next pages are decoded from there, and the server decodes the transaction once, not
        once per peek (issue 33). The raw messages are held until then (at most
        :data:`_SPOOL_AFTER_BYTES`, spooled as they come past that), so the spool starts where
        the peek did (the slot's position) and covers any position a later fetch starts from.
        """
        decoder = Decoder(loader(conn), skip_through=after)
        changes: list[Change] = []
        read, stopped = 0, False
        tape = _Tape()
        feed, wanted, write = decoder.feed, self._wanted, tape.write
        try:
            with closing(stream(conn, _PEEK_SQL, {"slot": self._slot, "n": n, "pub": self._publication})) as rows:
                cap = keep
                for data in rows:
                    read += 1
                    write(data)
                    done = feed(data)  # a transaction's changes, at its Commit
                    if done:
                        changes.extend([c for c in done if wanted(c)])
                        if cap > keep:  # the transaction the cap fell in ended: stop at its Commit
                            stopped = True
                            break
                    if len(changes) + decoder.pending >= cap:
                        if cap == keep and changes and decoder.in_transaction:
                            # The cap fell inside a transaction after others: read on to its Commit
                            # when it comes soon (an ordinary one), so the buffer ends at a boundary
                            # and the next pages peek on; only a larger one is spooled. A spool's
                            # end would end the page where the slot cannot move yet (see _spooled).
                            cap = keep + max(keep // _SLACK, 1)
                            continue
                        stopped = True
                        changes.extend([c for c in decoder.partial() if wanted(c)])
                        break
                if stopped and decoder.in_transaction:
                    self._spool_rest(tape.spool(), rows, changes)
        finally:
            tape.close()  # what was not kept
        keys: list[tuple[int, int]] = [(c.commit_lsn, c.seq) for c in changes]  # each change's key
        return Buffer(changes, keys, not stopped and read < n, flushed, read, since=after)

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
        self.drop_spool()
        self._spool = spool
        log.info("poller %s: a transaction of %d+ changes at %s is read once into a local spool (%d bytes); "
                 "pages come from it until the slot is past it", self._config.name, last[1] + 1, Lsn(last[0]),
                 spool.size, extra=ids(poller=self._config.name))  # fmt: skip

    def _spooled(self, conn: sa.Connection, after: tuple[int, int] | None, limit: int, keep: int) -> Buffer | None:
        """The changes after ``after`` from the spool, when it holds them (None: peek).

        Once its last change was read (``after`` is it), nothing until the slot is past it (a
        landed checkpoint there, acknowledged): a peek would decode the whole transaction again.
        The page ends there, marked ``more`` (``spool_end``): once that page's checkpoint landed,
        the next fetch moves the slot past the spool and peeks on (``before_peek``, in
        :meth:`read`); a read ahead of the landing finds nothing, and the tick ends there.
        """
        spool = self._spool
        if spool is None:
            return None
        if spool.delivered_by(after) and spool.end_lsn is not None:
            return Buffer([], [], True, spool.end_lsn, 0, spool_end=True, since=after)  # "read to its end": see _hint
        if spool.covers(after):
            keep, changes, end = max(limit, keep), [], False
            with closing(spool.changes(after, loader(conn))) as found:
                for c in found:
                    end = c.key == spool.last_key
                    if self._wanted(c):
                        changes.append(c)
                        if len(changes) >= keep:
                            break
            if end:  # a checkpoint here covers all of it that is ours (its tail may not be)
                spool.ours_until = changes[-1].key if changes else after
            return Buffer(changes, [c.key for c in changes], False, Lsn(0), 0, since=after)
        self.drop_spool()  # passed (another process delivered it): read the slot again
        return None

    def drop_spool(self) -> None:
        spool, self._spool = self._spool, None
        if spool is not None:
            spool.close()


def after_index(buffer: Buffer, key: tuple[int, int] | None) -> int:
    return 0 if key is None else bisect.bisect_right(buffer.keys, key)


def stream(conn: sa.Connection, query: str, params: dict[str, Any]) -> Generator[bytes, None, None]:
    """The first column of each row of ``query``, streamed by the driver itself (psycopg 3).

    One round trip, rows read off the socket in parts of :data:`_STREAM_ROWS` (single rows with a
    libpq older than 17), not held whole: SQLAlchemy's ``stream_results`` would declare a server
    cursor (three more round trips, a peek's largest cost). Stopping early cancels the rest.
    Runs in the transaction ``conn`` has begun; driver errors reach the caller as SQLAlchemy's.
    A stop that cancelled the statement may have aborted that transaction (a race with the
    server's end of the query): it is rolled back then, so the connection's next statement runs.
    """
    import psycopg  # an optional driver: see loader

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


def loader(conn: sa.Connection) -> TypeLoaders:
    """Text → Python with psycopg's own loaders: the same types a keyset fetch returns."""
    return _PsycopgLoaders(conn)


class _PsycopgLoaders:
    """psycopg's text loaders of one connection, each type's looked up once (a domain as its base type:
    docs/types.md); a value one refuses arrives as its text (:func:`~poller.sources.pg_logical.values.as_text`)."""

    def __init__(self, conn: sa.Connection) -> None:
        # Imported here, not at module level: psycopg is an optional driver (requirements-drivers.txt),
        # and apps whose pollers are keyset or outbox on another database never install it.
        from psycopg.adapt import Transformer

        self._conn = conn
        self._tx = Transformer(conn.connection.driver_connection)
        self._loads: dict[int, Callable[[bytes], Any]] = {}

    def for_type(self, oid: int) -> Callable[[bytes], Any]:
        load = self._loads.get(oid)
        if load is None:
            from psycopg.pq import Format

            load = self._loads[oid] = self._tx.get_loader(base_type(self._conn, oid), Format.TEXT).load
        return load

    def refused(self, oid: int, data: bytes, exc: Exception) -> Any:
        return as_text(oid, data, exc)

    def __call__(self, oid: int, data: bytes) -> Any:
        load = self.for_type(oid)
        try:
            return load(data)
        except Exception as exc:
            return self.refused(oid, data, exc)

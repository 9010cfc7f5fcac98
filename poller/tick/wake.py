"""How a lingering tick waits for a commit instead of polling: ``wake = "notify"`` or ``"wal"``.

``wake = "notify"``: a lingering tick waits on PostgreSQL LISTEN.

A statement-level trigger on each of the poller's tables (created by ``dbfanout validate --fix``,
dropped by ``dbfanout notify drop``) calls ``pg_notify(channel)`` in every writing transaction;
PostgreSQL delivers it when that transaction commits. The process that holds a notify poller's
lease keeps one LISTEN connection for it, across ticks, so a commit wakes the lingering tick at
once and an idle linger sends no query at all. A reader thread consumes the notifications
whenever the connection is open (a listener that does not read pins the cluster's notification
queue), and the connection is closed as soon as the process loses or gives up the lease
(:class:`~poller.runtime.PollerRuntime`). A lost notification (the LISTEN connection dropped)
only delays a change to the next timer tick, whose first fetch is the safety net; while the
connection is down the linger falls back to polling at ``poll_interval_ms``.

``wake = "wal"`` (pg_logical only, :class:`WalWaker`) needs no trigger: the linger watches the
server's WAL flush position instead, one tiny query every ``poll_interval_ms``.

psycopg is imported only here, and only when a notify (or wal) poller first listens.
"""

from __future__ import annotations

import hashlib
import re
import threading
import time
from typing import Any, Protocol

import sqlalchemy as sa

from shared.config import PollerConfig
from shared.logs import get_logger, ids

__all__ = [
    "NOTIFY_FUNCTION",
    "READ_SLICE",
    "NotifyWaker",
    "Waker",
    "WalWaker",
    "notify_channel",
    "notify_tables",
    "notify_trigger_name",
    "open_waker",
]

log = get_logger("poller.wake")

#: The trigger function every notify trigger calls with its channel (one per database).
NOTIFY_FUNCTION = "dbfanout_notify"
#: How long the LISTEN reader waits between checks of a stop request (seconds): a process that
#: gave its lease up has closed its LISTEN connection within this long.
READ_SLICE = 0.25


def _ident(prefix: str, poller: str) -> str:
    """A PostgreSQL identifier for ``poller``: ``prefix`` and the name when it is one already
    (lower-case letters, digits, ``_``; 63 bytes at most); otherwise the name made one, and a
    short hash of the name itself, so no two pollers share it (``orders-a``, ``orders_a``)."""
    plain = re.sub(r"[^a-z0-9_]", "_", poller.lower())
    if plain == poller and len(prefix + plain) <= 63:
        return prefix + plain
    digest = hashlib.sha256(poller.encode()).hexdigest()[:8]
    return f"{(prefix + plain)[: 63 - 9]}_{digest}"


def notify_channel(poller: PollerConfig) -> str:
    """The LISTEN channel of a poller: ``dbfanout_<poller>`` (see :func:`_ident`)."""
    return _ident("dbfanout_", poller.name)


def notify_trigger_name(poller: PollerConfig) -> str:
    return _ident("dbfanout_notify_", poller.name)


def notify_tables(poller: PollerConfig) -> tuple[str, ...]:
    """The tables whose commits wake the poller: pg_logical's tables, else its table (or outbox)."""
    if poller.kind == "pg_logical":
        return poller.tables
    return (poller.table,) if poller.table else ()


class NotifyWaker:
    """One LISTEN connection for one poller; :meth:`wait` returns True when a commit notified it.

    While the connection is open a reader thread consumes every notification as it arrives,
    whether or not a linger waits: PostgreSQL's notification queue is shared by the whole
    cluster, and a listening backend whose client does not read holds its tail back, until the
    queue fills and every notifying commit fails. The process closes the connection as soon as it
    loses or gives up the poller's lease (:meth:`close`): only the owner listens.
    """

    def __init__(self, poller: PollerConfig, *, connect_timeout: int = 10) -> None:
        self.poller = poller
        self.channel = notify_channel(poller)
        self._connect_timeout = connect_timeout
        self._lock = threading.Lock()
        self._reader: _Reader | None = None

    @property
    def ready(self) -> bool:
        """True while the LISTEN connection is up (else the linger polls at its interval)."""
        reader = self._reader
        return reader is not None and reader.alive

    @property
    def backend_pid(self) -> int | None:
        """The PostgreSQL backend of the LISTEN connection, while it is up (pg_stat_activity.pid)."""
        reader = self._reader
        return reader.backend_pid if reader is not None and reader.alive else None

    def listen(self) -> None:
        """Connect and LISTEN unless already listening. Never raises: a failure means polling.

        Forgets the notifications seen so far: the caller's next fetch reads what they announced.
        """
        with self._lock:
            if self._reader is not None and self._reader.alive:
                self._reader.notified.clear()
                return
            self._reader = None
            try:
                conn = self._connect()
            except Exception as exc:
                log.warning(
                    "LISTEN failed; the linger polls instead",
                    extra=ids(poller=self.poller.name, error=type(exc).__name__),
                )
                return
            self._reader = _Reader(conn, self.poller.name)

    def _connect(self) -> Any:
        import psycopg  # the optional driver, only for a notify poller

        url = sa.engine.make_url(self.poller.source_url).set(drivername="postgresql")
        conn = psycopg.connect(
            url.render_as_string(hide_password=False), autocommit=True, connect_timeout=self._connect_timeout
        )
        try:
            conn.execute(f"LISTEN {self.channel}")
        except BaseException:
            conn.close()
            raise
        return conn

    def wait(self, timeout: float) -> bool:
        """Block until a notification arrives (True) or ``timeout`` seconds pass (False)."""
        reader = self._reader
        if reader is None:
            return False
        if not reader.notified.wait(timeout):
            return False
        reader.notified.clear()
        if not reader.alive:
            log.warning(
                "LISTEN connection lost; the linger polls until the next tick listens again",
                extra=ids(poller=self.poller.name),
            )
            with self._lock:
                if self._reader is reader:
                    self._reader = None
        return True  # notified, or the connection dropped (a change may have been missed: poll now)

    def close(self) -> None:
        """Close the LISTEN connection (within :data:`READ_SLICE` seconds). Idempotent."""
        with self._lock:
            reader, self._reader = self._reader, None
        if reader is not None:
            reader.stop()


class _Reader:
    """The thread that owns a LISTEN connection: reads every notification, closes it on stop."""

    def __init__(self, conn: Any, poller: str) -> None:
        self._conn = conn
        self._poller = poller
        self.backend_pid: int = conn.info.backend_pid
        self.notified = threading.Event()
        self._stopping = threading.Event()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"listen-{poller}", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return not self._done.is_set()

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                # Reads (and so frees in the server's queue) everything that arrives in the slice.
                for _ in self._conn.notifies(timeout=READ_SLICE):
                    self.notified.set()
        except Exception as exc:
            if not self._stopping.is_set():
                log.warning(
                    "LISTEN connection lost; the linger polls until the next tick listens again",
                    extra=ids(poller=self._poller, error=type(exc).__name__),
                )
        finally:
            try:
                self._conn.close()
            except Exception as exc:  # closing a broken connection: nothing left to do
                log.debug("closing the LISTEN connection failed: %r", exc)
            self._done.set()
            self.notified.set()  # a waiting linger polls now instead of waiting for a dead connection

    def stop(self) -> None:
        """Ask the thread to close the connection, and wait for it to have done so."""
        self._stopping.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=READ_SLICE * 4)


class WalWaker:
    """``wake = "wal"`` (pg_logical): wakes when the server's WAL flush position moves.

    No trigger on the user's tables and no notify lock: one connection asks for
    ``pg_current_wal_flush_lsn()`` every ``poll_interval_ms`` (a function call, no table read, no
    decoding) while a linger waits, and :meth:`wait` returns True once the position moved since
    the last look, i.e. something committed (or wrote WAL) somewhere on the server. The drain
    that follows peeks the slot, and only then decodes. On a server whose WAL moves all the time
    for other reasons this is polling at ``poll_interval_ms`` without the idle back-off.
    """

    def __init__(self, poller: PollerConfig, *, connect_timeout: int = 10) -> None:
        self.poller = poller
        self._connect_timeout = connect_timeout
        self._interval = poller.poll_interval_ms / 1000
        self._conn: Any = None
        self._seen: str | None = None  # the flush position at the last look
        self._closed = threading.Event()
        self.checks = 0  # positions read so far (the cost on the database: one tiny query each)

    @property
    def ready(self) -> bool:
        """True while the connection is up (else the linger polls at its interval)."""
        return self._conn is not None

    def listen(self) -> None:
        """Connect unless connected, and take the current position as seen. Never raises."""
        self._closed.clear()
        try:
            if self._conn is None:
                import psycopg  # the PostgreSQL driver a pg_logical poller already uses

                url = sa.engine.make_url(self.poller.source_url).set(drivername="postgresql")
                self._conn = psycopg.connect(
                    url.render_as_string(hide_password=False), autocommit=True, connect_timeout=self._connect_timeout
                )
            self._seen = self._position()
        except Exception as exc:
            log.warning(
                "reading the WAL position failed; the linger polls instead",
                extra=ids(poller=self.poller.name, error=type(exc).__name__),
            )
            self.close()

    def _position(self) -> str:
        self.checks += 1
        return str(self._conn.execute("SELECT pg_current_wal_flush_lsn()").fetchone()[0])

    def wait(self, timeout: float) -> bool:
        """Look every ``poll_interval_ms`` until the position moves (True) or ``timeout`` passes."""
        if self._conn is None:
            return False
        deadline = time.monotonic() + timeout
        while True:
            try:
                position = self._position()
            except Exception as exc:
                log.warning(
                    "WAL position connection lost; the linger polls until the next tick connects again",
                    extra=ids(poller=self.poller.name, error=type(exc).__name__),
                )
                self.close()
                return True  # a change may have been missed: poll once now
            if position != self._seen:
                self._seen = position
                return True
            left = deadline - time.monotonic()
            if left <= 0 or self._closed.wait(min(self._interval, left)):
                return False

    def close(self) -> None:
        """Close the connection (the next :meth:`listen` opens another). Idempotent."""
        self._closed.set()
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                conn.close()
            except Exception as exc:  # closing a broken connection: nothing left to do
                log.debug("closing the WAL position connection failed: %r", exc)


class Waker(Protocol):
    """How a lingering tick waits for a commit (:meth:`poller.tick.lifecycle.Tick.linger`)."""

    @property
    def ready(self) -> bool:
        """True while waiting works; else the linger polls at ``poll_interval_ms``."""

    def listen(self) -> None:
        """Start watching (before the tick's first fetch). Never raises."""

    def wait(self, timeout: float) -> bool:
        """True when a commit may have happened since the last call, False after ``timeout``."""

    def close(self) -> None:
        """Stop watching and close any connection."""


def open_waker(poller: PollerConfig) -> Waker | None:
    """The waker of ``poller``'s ``wake`` setting; None for ``"poll"``."""
    if poller.wake == "notify":
        return NotifyWaker(poller)
    if poller.wake == "wal":
        return WalWaker(poller)
    return None

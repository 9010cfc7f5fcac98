"""``wake = "notify"``: a lingering tick waits on PostgreSQL LISTEN instead of polling.

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

psycopg is imported only here, and only when a notify poller first listens.
"""

from __future__ import annotations

import re
import threading
from typing import Any

import sqlalchemy as sa

from shared.config import PollerConfig
from shared.logs import get_logger, ids

__all__ = ["NOTIFY_FUNCTION", "READ_SLICE", "NotifyWaker", "notify_channel", "notify_tables", "notify_trigger_name"]

log = get_logger("poller.wake")

#: The trigger function every notify trigger calls with its channel (one per database).
NOTIFY_FUNCTION = "dbfanout_notify"
#: How long the LISTEN reader waits between checks of a stop request (seconds): a process that
#: gave its lease up has closed its LISTEN connection within this long.
READ_SLICE = 0.25


def _ident(prefix: str, poller: str) -> str:
    return (prefix + re.sub(r"\W", "_", poller.lower()))[:63]


def notify_channel(poller: PollerConfig) -> str:
    """The LISTEN channel of a poller: ``dbfanout_<poller>``."""
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

"""``wake = "notify"``: a lingering tick waits on PostgreSQL LISTEN instead of polling.

A statement-level trigger on each of the poller's tables (created by ``dbfanout validate --fix``,
dropped by ``dbfanout notify drop``) calls ``pg_notify(channel)`` in every writing transaction;
PostgreSQL delivers it when that transaction commits. The poller keeps one LISTEN connection per
notify poller, across ticks, so a commit wakes the lingering tick at once and an idle linger sends
no query at all. A lost notification (the LISTEN connection dropped) only delays a change to the
next timer tick, whose first fetch is the safety net; while the connection is down the linger
falls back to polling at ``poll_interval_ms``.

psycopg is imported only here, and only when a notify poller first listens.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

import sqlalchemy as sa

from shared.config import PollerConfig
from shared.logs import get_logger, ids

__all__ = ["NOTIFY_FUNCTION", "NotifyWaker", "notify_channel", "notify_tables", "notify_trigger_name"]

log = get_logger("poller.wake")

#: The trigger function every notify trigger calls with its channel (one per database).
NOTIFY_FUNCTION = "dbfanout_notify"


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
    """One LISTEN connection for one poller; :meth:`wait` returns True when a commit notified it."""

    def __init__(self, poller: PollerConfig, *, connect_timeout: int = 10) -> None:
        self.poller = poller
        self.channel = notify_channel(poller)
        self._connect_timeout = connect_timeout
        self._conn: Any = None

    @property
    def ready(self) -> bool:
        """True while the LISTEN connection is up (else the linger polls at its interval)."""
        return self._conn is not None

    def listen(self) -> None:
        """Connect and LISTEN unless already listening. Never raises: a failure means polling."""
        if self._conn is not None:
            return
        try:
            import psycopg  # the optional driver, only for a notify poller

            url = sa.engine.make_url(self.poller.source_url).set(drivername="postgresql")
            conn = psycopg.connect(
                url.render_as_string(hide_password=False), autocommit=True, connect_timeout=self._connect_timeout
            )
            conn.execute(f"LISTEN {self.channel}")
        except Exception as exc:
            log.warning(
                "LISTEN failed; the linger polls instead",
                extra=ids(poller=self.poller.name, error=type(exc).__name__),
            )
            return
        self._conn = conn

    def wait(self, timeout: float) -> bool:
        """Block until a notification arrives (True) or ``timeout`` seconds pass (False)."""
        if self._conn is None:
            return False
        try:
            return any(True for _ in self._conn.notifies(timeout=timeout, stop_after=1))
        except Exception as exc:
            log.warning(
                "LISTEN connection lost; the linger polls until the next tick listens again",
                extra=ids(poller=self.poller.name, error=type(exc).__name__),
            )
            self.close()
            return True  # a change may have been missed: poll once now

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                conn.close()
            except Exception as exc:  # closing a broken connection: nothing left to do
                log.debug("closing the LISTEN connection failed: %r", exc)

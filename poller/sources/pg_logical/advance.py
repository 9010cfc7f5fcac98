"""Where a pg_logical poller's slot may go, and moving it there (``pg_replication_slot_advance``).

Why its own module: reading the slot and moving it are separate jobs, and moving it is where WAL
is kept or freed. The slot goes only as far as a landed checkpoint covers: to the end of the
checkpoint's transaction when it was delivered whole, to its commit LSN otherwise; and, when the
last peek found nothing of the poller's after the checkpoint, to the log position that peek read
to (the server's flush position, which every database of the server moves), so a slot whose
tables are quiet does not hold WAL back.

That holds from the first tick on (issue 42): before any delivery the checkpoint has no position,
and a slot that waited for one held every byte of WAL the server wrote meanwhile. A peek that
found nothing before any checkpoint leaves a hint under the key None, and the tick's acknowledge
(with no position) moves the slot to it: nothing of the poller's lay behind it.

``restart_lsn`` (what PostgreSQL actually keeps) follows the confirmed position at the next
running-transactions record the server logs (every checkpoint, and every 15 s while WAL is
written), so the retained WAL stays bounded by that interval's writes.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import sqlalchemy as sa

from poller.snapshot.coordinator import Fetched
from poller.sources.pg_logical.peek import Buffer, SlotReader
from poller.sources.pg_logical.pgoutput import Change
from shared.config import PollerConfig
from shared.errors import SourceError
from shared.logs import get_logger, ids
from shared.models import Lsn, Position
from shared.telemetry import metrics

__all__ = ["SlotAdvancer", "position_key", "slot_status"]

log = get_logger("poller.pg_logical")

Key = tuple[int, int]

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


def position_key(position: Position | None) -> Key | None:
    """``(commit LSN, seq)`` of a pg_lsn position (None: none)."""
    if position is None:
        return None
    seq = position.pk.get("seq")
    if not isinstance(position.cursor, int) or not isinstance(seq, int):
        raise SourceError(
            f"the checkpoint {position.cursor!r}/{dict(position.pk)} is not a pg_lsn position",
            hint="this checkpoint was written by another source kind: `dbfanout checkpoint reset` the poller",
        )
    return (int(position.cursor), seq)


def slot_status(conn: sa.Connection, slot: str, publication: str | None) -> dict[str, Any] | None:
    """The slot as ``pg_replication_slots`` shows it, with the WAL it retains (None: no such slot)."""
    row = conn.execute(_SLOT, {"slot": slot}).mappings().first()
    if row is None:
        return None
    return {
        "slot": slot,
        "publication": publication,
        "plugin": row["plugin"],
        "active": bool(row["active"]),
        "wal_status": row["wal_status"],
        "confirmed_flush_lsn": row["confirmed"],
        "retained_wal_bytes": int(row["retained_bytes"] or 0),
        "lag_bytes": int(row["lag_bytes"] or 0),
    }


class SlotAdvancer:
    """The hints a tick's fetches leave, and the advance once a checkpoint landed (see the module docstring)."""

    def __init__(
        self,
        config: PollerConfig,
        reader: SlotReader,
        connection: Callable[[str], AbstractContextManager[sa.Connection]],
    ) -> None:
        self._config = config
        self._slot = config.slot or ""
        self._reader = reader
        self._connection = connection
        # Where the slot may go once a position a page ended at is a landed checkpoint (None: no
        # checkpoint yet); shared by the threads a tick's pages are read on, cleared by advance.
        self._hints: dict[Key | None, Lsn] = {}

    def hint(self, buffer: Buffer, fetched: Fetched[Change], to_end: bool) -> None:
        """Remember how far the slot may go once the page's end position is a landed checkpoint.

        Past the whole transaction when the page ends with its last change; to the log position
        the peek read to when nothing relevant follows (so an idle slot does not hold WAL back).
        A snapshot state change no row carries ends the page too (its ``advance``), so the slot
        never passes a request or a watermark before a checkpoint has its new state.
        """
        advance, rows = fetched.page.advance, fetched.page.rows
        key = (
            position_key(advance) if advance is not None else position_key(rows[-1].position) if rows else fetched.after
        )
        last = fetched.last
        idle = buffer.exhausted and to_end and (last is None or last.last_in_txn)
        if key is None and last is None:
            if idle:  # nothing of ours before the first checkpoint: the log read so far is free
                self._hints[None] = Lsn(max(buffer.flushed, self._hints.get(None, 0)))
            return
        start = Lsn(key[0]) if key is not None else Lsn(0)
        target = start if last is None else last.end_lsn if last.last_in_txn else last.commit_lsn
        if idle:
            target = Lsn(max(target, buffer.flushed))
        self._hints[key] = Lsn(max(target, self._hints.get(key, 0)))

    def clear(self) -> None:
        self._hints.clear()

    def advance_within(self, conn: sa.Connection, key: Key, at_least: int = 0) -> None:
        """Mid-tick, on the reading thread: move the slot as far as a landed checkpoint at ``key``
        allows, before a peek (issue 41: a peek decodes from the slot's position, so within a
        long tick each peek would decode again every change the tick already sent). The hints of
        later pages stay for the tick's own :meth:`advance`. ``at_least``: a spool's end, when the
        checkpoint covers all of it that is the poller's."""
        target = Lsn(max(self._hints.get(key, Lsn(key[0])), at_least))
        conn.execute(_ADVANCE, {"slot": self._slot, "lsn": str(target)})
        conn.commit()

    def advance(self, key: Key | None) -> None:
        """Move the slot as far as a landed checkpoint at ``key`` allows (best effort: the next tick
        tries again); record the WAL it still retains."""
        target = self._hints.pop(key, None if key is None else Lsn(key[0]))  # unknown: its commit LSN
        self._hints.clear()  # the others are behind this landed checkpoint (or were never sent)
        if target is None:
            return
        spool = self._reader.spool
        passed = key is not None and spool is not None and spool.passed_by(key)
        if passed and spool is not None and spool.end_lsn is not None:
            target = Lsn(max(target, spool.end_lsn))  # the spooled transaction was delivered whole
        try:
            with self._connection("acknowledge") as conn:
                conn.execute(_ADVANCE, {"slot": self._slot, "lsn": str(target)})
                conn.commit()
                if passed and spool is self._reader.spool:
                    self._reader.drop_spool()  # the slot is past it: the next peek starts after it
                status = slot_status(conn, self._slot, self._config.publication)
                conn.rollback()
            if status is not None:  # the WAL the slot still holds back (operators alert on it)
                attrs = {"poller": self._config.name, "slot": self._slot}
                metrics.retained_wal_bytes.record(status["retained_wal_bytes"], attrs)
                metrics.lag_wal_bytes.record(status["lag_bytes"], attrs)
        except SourceError as exc:  # FetchError included: nothing is lost, the slot just lags
            log.warning(
                "poller %s: could not advance slot %s to %s: %s", self._config.name, self._slot, target, exc,
                extra=ids(poller=self._config.name),
            )  # fmt: skip

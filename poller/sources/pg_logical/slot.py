"""A pg_logical poller's replication slot: is its log position still there, and replacing it when not.

PostgreSQL invalidates a slot that holds back more WAL than ``max_slot_wal_keep_size``
(``pg_replication_slots.wal_status = 'lost'``); a failover without slot synchronisation or an
operator drops it. Either way the changes committed after the slot's confirmed position are gone
from the log. The poller checks its slot at the start of each tick (one catalog query) and again
when a read fails:

* by default (``on_lost_position = "fail"``) it stops with a :class:`PositionLostError` naming the
  slot, what was lost and the one command that recovers (``dbfanout validate --fix``: it replaces
  the slot and requests a snapshot); ``poller.functions`` logs it once per state, ``dbfanout
  status`` shows it;
* with ``on_lost_position = "resnapshot"`` it recovers unattended, in two steps, each after a
  landed checkpoint (so a crash anywhere resumes, never skips):

  1. the checkpoint moves to *before the whole log* (LSN ``0/0``) with a snapshot of every table
     as its state — the state a ``dbfanout snapshot`` request makes (:func:`apply_request`) —
     written by the tick's CAS before the slot is touched;
  2. the next fetch finds that state and replaces the slot (drops the lost one, creates a new one)
     and reads the new slot from its start: its changes and the snapshot's chunks
     (:mod:`poller.snapshot.chunks`), which deliver every current row — the rows changed while the slot
     was lost included.

Why ``0/0`` (the trap of Debezium's DBZ-5739): a checkpoint skips every change at or before its
LSN. On the same server a new slot's changes come after the old checkpoint; after a failover to a
standby that was behind, or a restore, they can come *before* it and would be skipped silently.
Before the whole log, nothing of the new slot is skipped. For the same reason a checkpoint ahead
of the server's own log end is a lost position too.
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import sqlalchemy as sa

from poller.ports import Page
from poller.snapshot.requests import apply_request
from shared.config import PollerConfig
from shared.errors import PositionLostError, SourceError
from shared.logs import get_logger, ids
from shared.models import Lsn, Position
from shared.telemetry import metrics

__all__ = ["LOST_SNAPSHOT_PREFIX", "SlotGuard", "SlotHealth", "lost_error", "read_slot", "replace_slot"]

log = get_logger("poller.pg_slot")

#: The id of the snapshot ``on_lost_position = "resnapshot"`` runs starts with this.
LOST_SNAPSHOT_PREFIX = "lost-"
RUNBOOK = "'A replication slot was lost' in docs/operations.md"

# One row even when the slot does not exist: the server's log end comes with it.
_HEALTH = sa.text(
    "SELECT CAST(pg_current_wal_lsn() AS text) AS log_end, s.slot_name IS NOT NULL AS present, s.plugin,"
    " s.wal_status, CAST(s.confirmed_flush_lsn AS text) AS confirmed, s.safe_wal_size,"
    " pg_wal_lsn_diff(pg_current_wal_lsn(), s.restart_lsn) AS retained_bytes"
    " FROM (SELECT 1) AS one LEFT JOIN pg_replication_slots s ON s.slot_name = :slot"
)
_DROP = sa.text("SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = :slot")
_CREATE = sa.text("SELECT CAST(lsn AS text) FROM pg_create_logical_replication_slot(CAST(:slot AS name), 'pgoutput')")


@dataclass(frozen=True, slots=True)
class SlotHealth:
    """The slot as the catalog shows it, beside the server's log end."""

    slot: str
    present: bool
    plugin: str | None
    wal_status: str | None  # reserved, extended, unreserved (lost at the next checkpoint), lost
    confirmed: Lsn | None
    log_end: Lsn
    safe_wal_size: int | None  # bytes left before max_slot_wal_keep_size (None: no limit set)
    retained_bytes: int | None

    @property
    def lost(self) -> bool:
        """The log no longer holds the slot's changes (invalidated, or no slot at all)."""
        return not self.present or self.wal_status == "lost"


def read_slot(conn: sa.Connection, slot: str) -> SlotHealth:
    """The slot's health (one catalog query; it does not read the slot, so it never races a peek)."""
    row = conn.execute(_HEALTH, {"slot": slot}).mappings().one()
    return SlotHealth(
        slot=slot,
        present=bool(row["present"]),
        plugin=row["plugin"],
        wal_status=row["wal_status"],
        confirmed=Lsn.parse(row["confirmed"]) if row["confirmed"] else None,
        log_end=Lsn.parse(row["log_end"]),
        safe_wal_size=int(row["safe_wal_size"]) if row["safe_wal_size"] is not None else None,
        retained_bytes=int(row["retained_bytes"]) if row["retained_bytes"] is not None else None,
    )


def replace_slot(engine: sa.Engine, slot: str) -> Lsn:
    """Drop ``slot`` (if it exists) and create it again; the new slot's start (its consistent point).

    Each in a transaction of its own: a slot cannot be created in one that wrote. Creating waits
    for the transactions running at that moment to end (PostgreSQL needs a consistent point).
    """
    with engine.begin() as conn:
        conn.execute(_DROP, {"slot": slot})
    with engine.begin() as conn:
        return Lsn.parse(conn.execute(_CREATE, {"slot": slot}).scalar_one())


def _checkpoint_lsn(after: Position | None) -> Lsn | None:
    return Lsn(after.cursor) if after is not None and isinstance(after.cursor, int) else None


def lost_error(config: PollerConfig, health: SlotHealth, after: Position | None, url: str) -> PositionLostError:
    """The error of a lost position: the slot, what was lost, and the one command that recovers."""
    p, slot, checkpoint = config.name, health.slot, _checkpoint_lsn(after)
    if config.on_lost_position == "resnapshot":
        fix = (
            'on_lost_position = "resnapshot": the poller replaces the slot and snapshots every table at its next '
            "ticks (`dbfanout status` shows the snapshot); see " + RUNBOOK
        )
    else:
        fix = (
            f"run `dbfanout validate --fix {p}`: it replaces the slot and requests a snapshot of every table, "
            "which re-delivers every current row (a row deleted while the slot was lost is not: reconcile the "
            'target); or set on_lost_position = "resnapshot" to recover unattended; see ' + RUNBOOK
        )
    if health.present and health.wal_status == "lost":
        return PositionLostError(
            f"poller {p}: replication slot {slot!r} in {url} was invalidated by PostgreSQL (wal_status = lost: "
            f"it held back more WAL than max_slot_wal_keep_size allows): the changes committed after its "
            f"confirmed position {health.confirmed} (checkpoint {checkpoint}) are gone from the log and cannot be "
            "delivered from it",
            hint=fix,
        )
    if not health.present:
        return PositionLostError(
            f"poller {p}: replication slot {slot!r} does not exist in {url} any more (dropped, or a failover to a "
            f"server without it): the changes committed after the checkpoint {checkpoint} cannot be read from "
            "the log",
            hint=fix,
        )
    return PositionLostError(
        f"poller {p}: the checkpoint {checkpoint} is ahead of the end of the log of {url}: a "
        "restored or failed-over server; every change up to the checkpoint's position would be skipped",
        hint=f"`dbfanout checkpoint reset {p} --to-beginning --accept-fingerprint --yes`, then `dbfanout snapshot "
        f'{p}`; or set on_lost_position = "resnapshot" to recover unattended; see {RUNBOOK}',
    )


class SlotGuard:
    """The per-tick check of one poller's slot, and the unattended recovery (see the module docstring)."""

    def __init__(
        self,
        config: PollerConfig,
        engine: sa.Engine,
        url: str,
        estimate: Callable[[Sequence[str]], int | None],
        forget: Callable[[], None],
    ) -> None:
        self._config = config
        self._engine = engine
        self._url = url
        self._estimate = estimate
        self._forget = forget  # the source drops what it read of the old slot (buffers, chunks)
        self._checked = False
        self._warned: str | None = None

    def new_tick(self) -> None:
        """Check again at the next fetch (once per tick: a slot can be lost while the poller runs)."""
        self._checked = False

    def check(self, conn: sa.Connection, after: Position | None, *, force: bool = False) -> Page | None:
        """None to read on; a page to return instead (step 1 of a resnapshot); raises when lost."""
        if self._checked and not force:
            return None
        health = read_slot(conn, self._config.slot or "")
        self._observe(health)
        checkpoint = _checkpoint_lsn(after)
        ahead = checkpoint is not None and checkpoint > health.log_end
        if health.present and health.plugin != "pgoutput":
            raise SourceError(
                f"poller {self._config.name}: slot {health.slot!r} uses plugin {health.plugin!r}, not pgoutput",
                hint="drop it and recreate it with `dbfanout validate --fix`, or name another slot",
            )
        if not health.lost and not ahead:
            self._warn_unreserved(health)
            self._checked = True
            return None
        if not health.present and after is None:  # never ran: setting up, not a loss
            raise SourceError(
                f"poller {self._config.name}: replication slot {health.slot!r} does not exist in {self._url}",
                hint="create it (and the publication) with `dbfanout validate --fix`; see docs/operations.md",
            )
        if self._config.on_lost_position != "resnapshot":
            raise lost_error(self._config, health, after, self._url)
        if _pending(after):
            self._replace(health)
            self._checked = True
            return None
        return self._begin(health, after)

    def _begin(self, health: SlotHealth, after: Position | None) -> Page:
        """Step 1: the checkpoint before the whole log, with a snapshot of every table as its state."""
        now = dt.datetime.now(dt.UTC)
        request_id = f"{LOST_SNAPSHOT_PREFIX}{now:%Y%m%dT%H%M%SZ}-{uuid.uuid4().hex[:8]}"
        request = {"action": "snapshot", "tables": None, "where": None, "chunk_size": None}
        state, warning = apply_request(self._config, None, request, request_id, now)
        assert state is not None and warning is None  # every table of the poller: always accepted
        state = replace(state, estimate=self._estimate(state.tables))
        log.warning(
            "%s; on_lost_position = \"resnapshot\": snapshot %s of every table requested, the slot is replaced "
            "next (the checkpoint moves before the new slot's log, so none of its changes is skipped)",
            lost_error(self._config, health, after, self._url).args[0], request_id,
            extra=ids(poller=self._config.name),
        )  # fmt: skip
        return Page([], advance=Position(Lsn(0), {"seq": 0}, state))

    def _replace(self, health: SlotHealth) -> None:
        """Step 2: the snapshot is in the landed checkpoint; a slot that is still lost is replaced."""
        if not health.lost:
            return  # replaced before a crash (or by validate --fix): read it as it is
        start = replace_slot(self._engine, health.slot)
        self._forget()
        log.warning(
            "poller %s: replication slot %r replaced (it starts at %s); the snapshot of every table runs now",
            self._config.name, health.slot, start, extra=ids(poller=self._config.name),
        )  # fmt: skip

    def _warn_unreserved(self, health: SlotHealth) -> None:
        """Say once (per state) that the slot is about to be lost: PostgreSQL's last warning."""
        state = health.wal_status if health.wal_status == "unreserved" else None
        if state == self._warned:
            return
        self._warned = state
        if state is not None:
            log.warning(
                "poller %s: replication slot %r holds back more WAL than max_wal_size (wal_status = unreserved): "
                "PostgreSQL invalidates it at its next checkpoint unless the poller catches up; see %s",
                self._config.name, health.slot, RUNBOOK, extra=ids(poller=self._config.name),
            )  # fmt: skip

    def _observe(self, health: SlotHealth) -> None:
        """Retained WAL and its headroom, every tick: they matter most when a tick cannot commit."""
        attrs = {"poller": self._config.name, "slot": health.slot}
        if health.retained_bytes is not None:
            metrics.retained_wal_bytes.record(health.retained_bytes, attrs)
        if health.safe_wal_size is not None:
            metrics.wal_headroom_bytes.record(health.safe_wal_size, attrs)


def _pending(after: Position | None) -> bool:
    """Whether the checkpoint is step 1's: before the whole log, with the lost slot's snapshot not begun."""
    state = after.snapshot if after is not None else None
    return (
        after is not None
        and state is not None
        and after.cursor == 0
        and state.active
        and state.id.startswith(LOST_SNAPSHOT_PREFIX)
    )

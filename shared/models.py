"""Frozen value types shared by the poller and the worker.

Everything here is immutable; derive new values with :func:`dataclasses.replace`. Encoding to
JSON lives in :mod:`shared.codec` only.
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from decimal import Decimal
from typing import Any, Literal

__all__ = [
    "BATCH_SCHEMA",
    "STATE_VERSION",
    "Batch",
    "Checkpoint",
    "CursorScalar",
    "CursorValue",
    "HandlerContext",
    "Lease",
    "Lsn",
    "Op",
    "Position",
    "RowChange",
    "SnapshotState",
    "StateDoc",
]

STATE_VERSION = 1
BATCH_SCHEMA = "dbfanout.batch/1"

Op = Literal["upsert", "delete"]


class Lsn(int):
    """A PostgreSQL log sequence number; written the way PostgreSQL writes it (``16/B374D848``)."""

    __slots__ = ()

    def __str__(self) -> str:
        return f"{self >> 32:X}/{self & 0xFFFFFFFF:X}"

    def __repr__(self) -> str:
        return f"Lsn('{self}')"

    @classmethod
    def parse(cls, text: str) -> Lsn:
        """``'16/B374D848'`` → Lsn. Raises ValueError for anything else."""
        high, sep, low = text.partition("/")
        if not sep or not high or not low:
            raise ValueError(f"not an LSN: {text!r}")
        return cls((int(high, 16) << 32) | int(low, 16))


#: Scalar types a cursor or primary key value may have; each round-trips exactly.
CursorScalar = int | str | Decimal | uuid.UUID | dt.datetime | dt.date | float | bytes
#: A cursor is one scalar, or a tuple of scalars for a composite cursor.
CursorValue = CursorScalar | tuple[CursorScalar, ...]


@dataclass(frozen=True, slots=True)
class SnapshotState:
    """Where a snapshot of a ``pg_logical`` poller's tables stands (see poller.snapshot.chunks).

    It travels with the log position it is valid at (:attr:`Position.snapshot`), so it is written
    with the checkpoint, by the same CAS: a crash or a lease handover resumes after the last
    landed chunk. ``tables`` are the tables still to read, the current one first; ``last_key`` is
    the current table's last primary key already delivered (None: from its start). A finished
    snapshot keeps its counts (``finished_at`` set, ``tables`` empty) for ``dbfanout status``.
    """

    id: str
    tables: tuple[str, ...]
    chunk_size: int
    where: str | None = None
    last_key: Mapping[str, Any] | None = None
    rows: int = 0
    chunks: int = 0
    estimate: int | None = None  # rows the tables held when it started (pg_class.reltuples)
    started_at: dt.datetime | None = None
    finished_at: dt.datetime | None = None
    cancelled: bool = False  # finished by `dbfanout snapshot --cancel`, not by reading every row
    error: str | None = None  # why it stopped early (its chunk select failed: a bad --where, a dropped table)
    # chunk reads refused so far (a transaction committed but not yet visible: see poller.snapshot.chunks)
    refused: int = 0
    failures: int = 0  # chunk statements of the current table that failed in a row (bounded: then error)

    @property
    def active(self) -> bool:
        return self.finished_at is None and bool(self.tables)


@dataclass(frozen=True, slots=True)
class Position:
    """A point in the keyset order: ``(cursor, pk...)``. Rows strictly after it are pending.

    ``snapshot``: a pg_logical poller's snapshot as of this point of its log (None: none ran).
    """

    cursor: CursorValue
    pk: Mapping[str, Any]
    snapshot: SnapshotState | None = None


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """How far the poller has handed rows to the sink (acknowledged by a committed write)."""

    position: Position | None = None
    last_successful_batch_id: str | None = None
    updated_at: dt.datetime | None = None
    metadata: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Lease:
    """Who may write the poller's checkpoint, and until when. ``owner_id`` None means free."""

    owner_id: str | None
    fencing_token: int
    acquired_at: dt.datetime | None = None
    heartbeat_at: dt.datetime | None = None
    expires_at: dt.datetime | None = None

    def is_free(self, now: dt.datetime, skew_margin: dt.timedelta) -> bool:
        """True when nobody holds the lease, or its holder let it lapse (past the skew margin)."""
        if self.owner_id is None or self.expires_at is None:
            return True
        return now >= self.expires_at + skew_margin


@dataclass(frozen=True, slots=True)
class StateDoc:
    """The one state blob per poller: checkpoint and lease, changed together by CAS writes."""

    poller_name: str
    source_fingerprint: str
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    lease: Lease = field(default_factory=lambda: Lease(owner_id=None, fencing_token=0))
    version: int = STATE_VERSION

    def with_checkpoint(self, checkpoint: Checkpoint) -> StateDoc:
        return replace(self, checkpoint=checkpoint)

    def with_lease(self, lease: Lease) -> StateDoc:
        return replace(self, lease=lease)


@dataclass(frozen=True, slots=True)
class RowChange:
    """One changed row, as a handler receives it (the README's handler section has the same table).

    Attributes:
        event_id: stable across every redelivery, split and replay of the same row state (a hash
            of poller, source fingerprint, pk and cursor): handlers de-duplicate on it.
        op: ``"upsert"``, or ``"delete"`` for a soft-deleted row, an outbox delete or a
            pg_logical delete.
        pk: the primary key columns, e.g. ``{"id": 42}``.
        cursor: the cursor value with its type (int, str, Decimal, tz-aware datetime, UUID, ...,
            or a tuple of them); pg_logical: the commit LSN.
        after: the row's columns; None for a pg_logical delete.
        poller: the poller that read the change.
        before: None for cursor polling (the previous state is not known); pg_logical: the old
            key, or the old row with ``REPLICA IDENTITY FULL``.
        source: reserved for source details; empty today.
        change: the precise change when the source knows it (``op`` stays the coarse
            ``upsert``/``delete``): the outbox row's ``type`` for an outbox source,
            ``insert``/``update``/``delete`` for a change-log source, ``read`` for a row a snapshot
            read (``op`` upsert); None for cursor polling.
        table: the table the row came from, schema-qualified where the source knows the schema
            (``public.orders`` from pg_logical; as configured for a keyset poller on a table; the
            outbox table for an outbox row); None for a ``query`` poller and in messages written
            before it existed.
        committed_at: when the source committed the change, where it knows it (the transaction's
            commit time for pg_logical, the outbox row's ``created_at``, a cursor declared as the
            commit time); None otherwise. Used for the commit-to-handler latency metric.
        epoch: the poller's order epoch when it sent the change (0 until its cursors first went
            backwards: a failover to a server whose GTIDs sort lower, a promotion to a standby that
            was behind, a replaced slot). Order changes of one key by ``(epoch, cursor)``, never by
            ``cursor`` alone; :class:`worker.ordering.LatestVersions` does. 0 in older messages.
    """

    event_id: str
    op: Op
    pk: Mapping[str, Any]
    cursor: CursorValue
    after: Mapping[str, Any] | None
    poller: str
    before: Mapping[str, Any] | None = None
    source: Mapping[str, Any] = field(default_factory=dict)
    change: str | None = None
    table: str | None = None
    committed_at: dt.datetime | None = field(default=None, compare=False)  # telemetry, not identity
    epoch: int = field(default=0, compare=False)  # order across cursor regressions, not identity


@dataclass(frozen=True, slots=True)
class Batch:
    """What the poller hands to a sink: one page of events of one poller."""

    poller: str
    batch_id: str
    source_fingerprint: str
    events: Sequence[RowChange]  # a tuple, or built on first access (the poller's LazyEvents)
    schema: str = BATCH_SCHEMA
    # Optional envelope fields (telemetry): when the poller read the page, and the W3C trace
    # context of the span that sent it (how storage queues carry it; Service Bus also has it in
    # the traceparent / Diagnostic-Id application properties).
    read_at: dt.datetime | None = field(default=None, compare=False)
    traceparent: str | None = field(default=None, compare=False)
    # The poller's order epoch for every event of the batch (RowChange.epoch): bumped when its
    # cursors went backwards; a page spanning two epochs is sent as two batches. It travels in the
    # envelope, and decoding gives it to each event (the poller's own events are not rebuilt for it).
    epoch: int = 0


@dataclass(frozen=True, slots=True)
class HandlerContext:
    """What a handler knows about the message it is handling.

    Attributes:
        poller: the poller whose queue or topic the message came from.
        message_id: the Service Bus (or storage queue) message id: the batch's idempotency key;
            a split single or a DLQ replay has its own.
        delivery_count: follows the Azure Functions host: 1 on the first delivery.
        enqueued_time: when the message was enqueued (UTC), if the transport says.
        batch_id: the poller's batch id (the page the events were read in).
        application_properties: the message's application properties (``dbfanout-schema``,
            ``dbfanout-poller``, ``dbfanout-event-count``, ``dbfanout-batch-id``; a split single's
            ``dbfanout-split-from``; a replay's ``dbfanout-replay-*``; a topic's ``dbfanout-to``).
        subscription: the topic subscription the message was received on; None for a queue.
    """

    poller: str
    message_id: str
    delivery_count: int
    enqueued_time: dt.datetime | None
    batch_id: str | None = None
    application_properties: Mapping[str, Any] = field(default_factory=dict)
    subscription: str | None = None

"""What the live view shows, read from the pipeline's own records.

* enqueued: the poller's committed checkpoint in its state blob (the cursor is the writer's
  version, so it counts the changes handed to Service Bus; a slot's commit LSN or a binlog
  position is mapped back to versions by the writer);
* handled / distinct / duplicates: the example handler's processed-events and duplicates tables;
* queue and DLQ depth: the in-process emulator (``--topic``: summed over the subscriptions);
* ``--topic``: the audit subscription's record (events it was given, and how many more than once);
* a pg_logical poller's snapshot (``--source pg-logical``): its progress in the state blob, as
  ``dbfanout status`` shows it (table, chunk, rows, rate, ETA).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa
from azure.core.exceptions import AzureError, ResourceNotFoundError
from azure.storage.blob import BlobServiceClient

from dbfanout.demo.handler import AUDIT_TABLE
from dbfanout.demo.writer import SourceWriter
from dbfanout.ops.status import snapshot_progress
from poller.sources.mysql_binlog.position import BinlogPosition
from sbemulator import Emulator
from sbemulator.config import subscription_path
from shared.codec import decode_state
from shared.models import Lsn

__all__ = ["Probe", "Snapshot"]


@dataclass(frozen=True, slots=True)
class Snapshot:
    """One refresh of the live view."""

    elapsed: float
    phase: str
    written: dict[str, int]
    version: int  # the writer's last version: changes written so far
    enqueued: int  # changes up to the committed checkpoint
    lag_changes: int
    lag_seconds: float
    queue_messages: int
    handled: int  # handler invocations per event, duplicates included
    distinct: int  # distinct event ids handled
    duplicates: int  # handled - distinct: redeliveries absorbed by the processed-events table
    dlq: int
    log: tuple[str, ...] = field(default=())
    # --topic: events the audit subscription was given, and those given more than once (must be 0).
    audit_events: int | None = None
    audit_duplicates: int | None = None
    # A pg_logical poller's snapshot as of its last checkpoint (dbfanout.ops.status.snapshot_progress).
    snapshot: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "enqueued_changes": self.enqueued,
            "handled_events": self.handled,
            "distinct_events": self.distinct,
            "duplicates_absorbed": self.duplicates,
            "queue_messages": self.queue_messages,
            "dlq": self.dlq,
        }
        if self.audit_events is not None:
            out["audit"] = {"events": self.audit_events, "given_more_than_once": self.audit_duplicates}
        if self.snapshot is not None:
            out["snapshot"] = self.snapshot
        return out


class Probe:
    """Reads the counters; cheap enough to run twice a second."""

    def __init__(
        self,
        *,
        storage: str,
        app_name: str,
        poller: str,
        queue: str,
        emulator: Emulator,
        target: sa.Engine,
        subscriptions: tuple[str, ...] = (),
        binlog: bool = False,
    ) -> None:
        self._blob = BlobServiceClient.from_connection_string(storage).get_blob_client(
            "db-state", f"state/{app_name}/{poller}.json"
        )
        # A topic's messages wait in its subscriptions: count those (and their DLQs).
        self._entities = [subscription_path(queue, s) for s in subscriptions] or [queue]
        self.topic = bool(subscriptions)
        self.binlog = binlog  # a mysql_binlog poller: its checkpoint is a binlog position, not a version
        self._emulator = emulator
        self.target = target
        self._last_checkpoint = 0
        self.checkpointed = False  # the poller has committed a checkpoint (read with it)
        self.last_snapshot: dict[str, Any] | None = None  # read with the checkpoint

    def checkpoint(self, writer: SourceWriter) -> int:
        """The committed checkpoint as a version (0 before the first commit); the last value on a read error.

        A replication-slot checkpoint is a commit LSN, a binlog one a transaction's start and a row
        index in it: the writer maps them back to its versions.
        """
        try:
            doc = decode_state(self._blob.download_blob(timeout=5).readall())
        except ResourceNotFoundError:
            return 0
        except AzureError:
            return self._last_checkpoint  # a slow read must not stall the view
        position = doc.checkpoint.position
        self.checkpointed = self.checkpointed or position is not None
        if position is not None and position.snapshot is not None:
            self.last_snapshot = snapshot_progress(position.snapshot, doc.checkpoint.updated_at)
        if position is not None and self.binlog:
            at = BinlogPosition.from_position(position)
            self._last_checkpoint = writer.version_at_binlog((at.file_number, at.txn_pos), at.seq)
        elif position is not None and isinstance(position.cursor, Lsn):
            self._last_checkpoint = writer.version_at_lsn(position.cursor)
        elif position is not None and isinstance(position.cursor, int):
            self._last_checkpoint = position.cursor
        return self._last_checkpoint

    def queue_depths(self) -> tuple[int, int]:
        """(messages in the queue, messages in its dead-letter queue)."""
        stats = [self._emulator.queue_stats(entity) for entity in self._entities]
        return sum(s["messages"] for s in stats), sum(s["dead_lettered"] for s in stats)

    def handled(self) -> tuple[int, int]:
        """(distinct events handled, duplicates absorbed)."""
        counts = []
        with self.target.connect() as conn:
            for table in ("dbfanout_processed_events", "dbfanout_example_duplicates"):
                exists = conn.execute(sa.text("SELECT 1 FROM sqlite_master WHERE name = :t"), {"t": table}).first()
                counts.append(int(conn.execute(sa.text(f"SELECT count(*) FROM {table}")).scalar_one()) if exists else 0)
        return counts[0], counts[1]

    def audit(self) -> tuple[int, int]:
        """(events the audit subscription was given, events it was given more than once)."""
        with self.target.connect() as conn:
            if conn.execute(sa.text("SELECT 1 FROM sqlite_master WHERE name = :t"), {"t": AUDIT_TABLE}).first() is None:
                return 0, 0
            row = conn.execute(sa.text(f"SELECT count(*), coalesce(sum(deliveries > 1), 0) FROM {AUDIT_TABLE}")).one()
            return int(row[0]), int(row[1])

    def snapshot(self, writer: SourceWriter, *, started: float, phase: str, log: tuple[str, ...]) -> Snapshot:
        enqueued = self.checkpoint(writer)
        messages, dlq = self.queue_depths()
        distinct, duplicates = self.handled()
        audit_events, audit_duplicates = self.audit() if self.topic else (None, None)
        return Snapshot(
            elapsed=time.monotonic() - started,
            phase=phase,
            written=dict(writer.ops),
            version=writer.version,
            enqueued=enqueued,
            lag_changes=max(0, writer.version - enqueued),
            lag_seconds=writer.seconds_behind(enqueued),
            queue_messages=messages,
            handled=distinct + duplicates,
            distinct=distinct,
            duplicates=duplicates,
            dlq=dlq,
            log=log,
            audit_events=audit_events,
            audit_duplicates=audit_duplicates,
            snapshot=self.last_snapshot,
        )

"""The poller's ports: the three things a tick talks to. Adapters live in their own modules.

Every adapter of a port keeps the same contract, fakes included (the in-memory state store
rejects a stale ETag exactly like the blob one), and contract tests run against all of them.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from shared.models import Batch, Checkpoint, CursorValue, Position, StateDoc

__all__ = ["Page", "Sink", "Snapshot", "Source", "SourceRow", "StateStore"]


@dataclass(frozen=True, slots=True)
class Snapshot:
    """A state document together with the ETag it was read or written with."""

    doc: StateDoc
    etag: str


class StateStore(Protocol):
    """One state blob per poller; every mutation is exactly one conditional write (STYLE R1)."""

    poller_name: str

    def load(self) -> Snapshot | None:
        """Read the state blob (None when it does not exist yet). Raises StateUnavailableError."""
        ...

    def try_acquire(self, owner_id: str, ttl: dt.timedelta, fingerprint: str) -> Snapshot | None:
        """Take the lease when free or lapsed (past the skew margin); bump the fencing token.

        Returns None when someone else holds it or won the race: a lost race is an outcome,
        not an error. Creates the blob (If-None-Match: *) on first use.
        """
        ...

    def heartbeat(self, snap: Snapshot, ttl: dt.timedelta) -> Snapshot:
        """Extend our lease (If-Match). Raises LostLeaseError when the ETag moved."""
        ...

    def commit(self, snap: Snapshot, checkpoint: Checkpoint, ttl: dt.timedelta | None = None) -> Snapshot:
        """Write the checkpoint (If-Match), optionally extending the lease in the same write.

        Raises LostLeaseError (ETag moved: W4), CommitAmbiguousError (timeout: W5) or
        CommitError (other failure: W1).
        """
        ...

    def release(self, snap: Snapshot) -> Snapshot:
        """Give the lease up so it is immediately re-acquirable (If-Match). LostLeaseError if moved."""
        ...

    def replace(self, snap: Snapshot | None, doc: StateDoc) -> Snapshot:
        """Operator write (CLI reset/clone): CAS against ``snap`` (or create when None)."""
        ...


@dataclass(frozen=True, slots=True)
class SourceRow:
    """One row as fetched: its keyset position, and its column values."""

    position: Position
    values: dict[str, Any]
    deleted: bool = False

    @property
    def cursor(self) -> CursorValue:
        return self.position.cursor


@dataclass(frozen=True, slots=True)
class Page:
    """One keyset page, in ``(cursor, pk)`` order. ``rows`` empty means caught up."""

    rows: Sequence[SourceRow]
    skipped_null_cursors: int = 0
    notes: dict[str, Any] = field(default_factory=dict)

    @property
    def last(self) -> Position | None:
        return self.rows[-1].position if self.rows else None


class Source(Protocol):
    """A database table or query read in keyset order."""

    @property
    def fingerprint(self) -> str:
        """Hash of the source definition (URL without password, table/query, cursor, pk, filter)."""
        ...

    def fetch(self, after: Position | None, limit: int) -> Page:
        """Rows strictly after ``after`` in ``(cursor, pk)`` order, at most ``limit``.

        Only rows older than the settle window (on the database clock) are returned.
        Raises FetchError (transient) or SourceError/CursorError (fix the config or data).
        """
        ...

    def close(self) -> None: ...


class Sink(Protocol):
    """Where batches go. ``send`` returns only when every message of the batch was accepted."""

    def send(self, batch: Batch) -> None:
        """Raises EnqueueError when any message was not accepted (the checkpoint must not move)."""
        ...

    def close(self) -> None: ...

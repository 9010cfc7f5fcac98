"""In-memory StateStore: the fake tests use, with the blob store's exact contract (STYLE R8).

The document is kept *encoded* (through :mod:`shared.codec`), ETags are counters, and a stale
ETag raises LostLeaseError just like a 412 from Blob Storage. Several stores may share one
:class:`MemoryBlob` (two instances pointing at the same blob). Fault hooks let tests inject
the failures of the blob adapter: an outage, a failed or ambiguous commit.
"""

from __future__ import annotations

import datetime as dt
import threading
from dataclasses import dataclass, field
from typing import Literal

from poller.lease.protocol import Clock, utcnow
from poller.ports import Snapshot
from poller.state.store import ConditionalStateStore, WriteOp
from shared.codec import decode_state, encode_state
from shared.errors import CommitAmbiguousError, CommitError, LostLeaseError, StateUnavailableError
from shared.models import StateDoc

__all__ = ["CommitFault", "MemoryBlob", "MemoryStateStore"]

CommitFault = Literal["error", "ambiguous_applied", "ambiguous_lost"]


@dataclass
class MemoryBlob:
    """One state blob: bytes, an ETag counter, and a count of the writes that landed."""

    data: bytes | None = None
    version: int = 0
    writes: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def etag(self) -> str:
        return f'"{self.version}"'


class MemoryStateStore(ConditionalStateStore):
    """A StateStore over a :class:`MemoryBlob`; thread-safe."""

    def __init__(
        self,
        poller_name: str,
        *,
        clock: Clock = utcnow,
        skew_margin: dt.timedelta | None = None,
        blob: MemoryBlob | None = None,
    ) -> None:
        super().__init__(poller_name, clock=clock, skew_margin=skew_margin)
        self.blob = blob if blob is not None else MemoryBlob()
        self._commit_faults: list[CommitFault] = []
        self.unavailable = False  # True: every call raises StateUnavailableError (storage down)

    def peer(self, *, clock: Clock | None = None) -> MemoryStateStore:
        """Another store on the same blob (a second instance of the function app)."""
        return MemoryStateStore(
            self.poller_name, clock=clock or self._clock, skew_margin=self._skew_margin, blob=self.blob
        )

    # -- fault hooks ---------------------------------------------------------------------------

    def fail_next_commit(self, kind: CommitFault = "error") -> None:
        """Make the next commit fail: ``error`` (CommitError, nothing written), ``ambiguous_lost``
        (CommitAmbiguousError, nothing written) or ``ambiguous_applied`` (written, then
        CommitAmbiguousError: the response was lost)."""
        self._commit_faults.append(kind)

    def raw(self) -> bytes | None:
        with self.blob.lock:
            return self.blob.data

    def put_raw(self, data: bytes | None) -> None:
        """Overwrite the stored bytes (e.g. a corrupt blob), bumping the ETag like any write."""
        with self.blob.lock:
            self._store(data)

    # -- StateStore ----------------------------------------------------------------------------

    def load(self) -> Snapshot | None:
        with self.blob.lock:
            self._check_available("load")
            if self.blob.data is None:
                return None
            return Snapshot(decode_state(self.blob.data), self.blob.etag)

    def put(self, op: WriteOp, doc: StateDoc, etag: str | None) -> Snapshot:
        fault = self._commit_faults.pop(0) if op == "commit" and self._commit_faults else None
        if fault == "error":
            raise CommitError("commit failed (injected); nothing was written")
        if fault == "ambiguous_lost":
            raise CommitAmbiguousError("commit timed out (injected); nothing was written")
        new = self._write(op, etag, doc)
        if fault == "ambiguous_applied":
            raise CommitAmbiguousError(f"commit timed out (injected) after landing as {new.etag}")
        return new

    # -- internals -----------------------------------------------------------------------------

    def _check_available(self, op: str) -> None:
        if self.unavailable:
            if op == "commit":
                raise CommitError("state storage unreachable (injected); nothing was written")
            raise StateUnavailableError(f"{op}: state storage unreachable (injected)")

    def _write(self, op: str, if_match: str | None, doc: StateDoc) -> Snapshot:
        """One conditional write: create when ``if_match`` is None, else CAS on the ETag."""
        data = encode_state(doc)
        with self.blob.lock:
            self._check_available(op)
            if if_match is None and self.blob.data is not None:
                raise LostLeaseError(f"{op}: the state blob already exists (created concurrently)")
            if if_match is not None and (self.blob.data is None or if_match != self.blob.etag):
                raise LostLeaseError(f"{op}: the state blob changed since it was read (lease taken over)")
            self._store(data)
            return Snapshot(doc, self.blob.etag)

    def _store(self, data: bytes | None) -> None:
        self.blob.data = data
        self.blob.version += 1
        self.blob.writes += 1

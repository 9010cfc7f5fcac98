"""What every StateStore adapter decides the same way; an adapter supplies only its I/O.

:class:`ConditionalStateStore` implements the :class:`~poller.ports.StateStore` operations once:
it reads the state (``load``), computes the next document with the pure transitions of
:mod:`poller.lease.protocol`, and hands it to the adapter's one conditional write (``put``: create when
there is no ETag, compare-and-swap on it otherwise; STYLE R1). The blob store and the in-memory
fake differ only in how they read and write bytes, so their lease decisions cannot drift apart.
"""

from __future__ import annotations

import datetime as dt
from abc import ABC, abstractmethod
from typing import Literal

from poller.lease.protocol import (
    Clock,
    acquired,
    check_poller_name,
    committed,
    default_skew_margin,
    heartbeated,
    released,
    utcnow,
)
from poller.ports import Snapshot
from shared.errors import LostLeaseError
from shared.logs import get_logger, ids
from shared.models import Checkpoint, StateDoc

__all__ = ["ConditionalStateStore", "WriteOp"]

log = get_logger("poller.state")

#: The conditional writes a store makes; adapters map their failures by it (a commit's are W1/W5).
WriteOp = Literal["acquire", "heartbeat", "commit", "release", "replace"]


class ConditionalStateStore(ABC):
    """The StateStore port over an adapter's ``load`` and ``put`` (one conditional write)."""

    def __init__(self, poller_name: str, *, clock: Clock = utcnow, skew_margin: dt.timedelta | None = None) -> None:
        self.poller_name = poller_name
        self._clock = clock
        self._skew_margin = skew_margin

    # -- the adapter's I/O ---------------------------------------------------------------------

    @abstractmethod
    def load(self) -> Snapshot | None:
        """Read the state (None when it does not exist yet). Raises StateUnavailableError."""

    @abstractmethod
    def put(self, op: WriteOp, doc: StateDoc, etag: str | None) -> Snapshot:
        """Write ``doc`` in one conditional write: create when ``etag`` is None, else If-Match.

        Raises LostLeaseError when the condition fails (the state moved: W4); ``op`` names the
        operation (acquire, heartbeat, commit, release, replace) for the adapter's error mapping.
        """

    # -- StateStore ----------------------------------------------------------------------------

    def try_acquire(self, owner_id: str, ttl: dt.timedelta, fingerprint: str) -> Snapshot | None:
        """Take the lease when free or lapsed; None when held elsewhere or a racing owner won."""
        snap = self.load()
        skew = self._skew_margin if self._skew_margin is not None else default_skew_margin(ttl)
        doc = acquired(snap.doc if snap else None, self.poller_name, owner_id, ttl, fingerprint, self._clock(), skew)
        if doc is None:
            log.debug("lease held by another owner", extra=ids(poller=self.poller_name, owner=owner_id))
            return None
        try:
            return self.put("acquire", doc, snap.etag if snap else None)
        except LostLeaseError:
            log.debug("lost the race for the lease", extra=ids(poller=self.poller_name, owner=owner_id))
            return None

    def heartbeat(self, snap: Snapshot, ttl: dt.timedelta) -> Snapshot:
        """Extend our lease (If-Match). Raises LostLeaseError when the ETag moved."""
        return self.put("heartbeat", heartbeated(snap.doc, ttl, self._clock()), snap.etag)

    def commit(self, snap: Snapshot, checkpoint: Checkpoint, ttl: dt.timedelta | None = None) -> Snapshot:
        """Write the checkpoint (If-Match), extending the lease in the same write when ``ttl``."""
        return self.put("commit", committed(snap.doc, checkpoint, ttl, self._clock()), snap.etag)

    def release(self, snap: Snapshot) -> Snapshot:
        """Give the lease up (If-Match) so anyone may take it at once."""
        return self.put("release", released(snap.doc, self._clock()), snap.etag)

    def replace(self, snap: Snapshot | None, doc: StateDoc) -> Snapshot:
        """Operator write (CLI reset/clone): CAS against ``snap``, or create when None."""
        check_poller_name(doc, self.poller_name)
        return self.put("replace", doc, snap.etag if snap else None)

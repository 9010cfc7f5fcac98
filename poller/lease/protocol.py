"""The lease protocol: the pure transitions of the state document's lease, and the clock.

The transitions (:func:`acquired`, :func:`heartbeated`, :func:`committed`, :func:`released`) are
pure functions of a :class:`~shared.models.StateDoc` and a clock reading (seed 002 §6-§8); each
StateStore adapter sends their result in exactly one conditional write (STYLE R1,
:class:`~poller.state.store.ConditionalStateStore`), so the blob store and the in-memory fake
cannot drift apart. The lease's life in a process (take, keep, renew, release) is
:mod:`poller.lease.keeper`'s.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from dataclasses import replace

from shared.errors import FingerprintMismatchError, LostLeaseError
from shared.models import Checkpoint, Lease, StateDoc

__all__ = [
    "Clock",
    "acquired",
    "check_poller_name",
    "committed",
    "default_skew_margin",
    "heartbeated",
    "released",
    "same_holder",
    "utcnow",
]


#: Returns the current time, tz-aware. Injected everywhere time matters (tests use a fake).
Clock = Callable[[], dt.datetime]

_MAX_SKEW = dt.timedelta(seconds=5)


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def default_skew_margin(ttl: dt.timedelta) -> dt.timedelta:
    """How long past ``expires_at`` a lease stays untouchable: ``min(ttl / 2, 5 s)``."""
    return min(ttl / 2, _MAX_SKEW)


# --------------------------------------------------------------------------------------------
# Pure transitions (seed 002 §6-§8)


def acquired(
    current: StateDoc | None,
    poller_name: str,
    owner_id: str,
    ttl: dt.timedelta,
    fingerprint: str,
    now: dt.datetime,
    skew_margin: dt.timedelta,
) -> StateDoc | None:
    """The document that makes ``owner_id`` the holder, or None when the lease is still held.

    A new document starts at fencing token 1; a lapsed (or released) lease is taken with the
    token bumped by one. A live lease that already names ``owner_id`` is ours (an earlier
    acquire or heartbeat landed although its answer was lost): it is renewed with its token
    kept, since no one else can have written under it. A document written for another source
    definition is never taken: FingerprintMismatchError (seed 002 §9: reject execution until an
    explicit reset).
    """
    if current is None:
        return StateDoc(
            poller_name=poller_name,
            source_fingerprint=fingerprint,
            lease=Lease(owner_id, 1, acquired_at=now, heartbeat_at=now, expires_at=now + ttl),
        )
    if current.source_fingerprint != fingerprint:
        raise FingerprintMismatchError(
            f"poller {poller_name!r}: the state blob was written for source {current.source_fingerprint!r}, "
            f"this poller's source is {fingerprint!r}"
        )
    lease = current.lease
    if not lease.is_free(now, skew_margin):
        if lease.owner_id != owner_id:
            return None
        # Owner ids carry a per-process nonce, so this is our own hold: adopt its token.
        return current.with_lease(replace(lease, heartbeat_at=now, expires_at=now + ttl))
    token = current.lease.fencing_token + 1
    return current.with_lease(Lease(owner_id, token, acquired_at=now, heartbeat_at=now, expires_at=now + ttl))


def _require_owner(doc: StateDoc, op: str) -> Lease:
    if doc.lease.owner_id is None:
        raise LostLeaseError(f"{op}: the snapshot holds no lease (released or never acquired); nothing was written")
    return doc.lease


def heartbeated(doc: StateDoc, ttl: dt.timedelta, now: dt.datetime) -> StateDoc:
    """Same owner and token, ``expires_at = now + ttl``."""
    lease = _require_owner(doc, "heartbeat")
    return doc.with_lease(replace(lease, heartbeat_at=now, expires_at=now + ttl))


def committed(doc: StateDoc, checkpoint: Checkpoint, ttl: dt.timedelta | None, now: dt.datetime) -> StateDoc:
    """The checkpoint replaced; with ``ttl`` the lease is extended in the same write."""
    lease = _require_owner(doc, "commit")
    new = doc.with_checkpoint(checkpoint)
    if ttl is not None:
        new = new.with_lease(replace(lease, heartbeat_at=now, expires_at=now + ttl))
    return new


def released(doc: StateDoc, now: dt.datetime) -> StateDoc:
    """No owner and ``expires_at = now``: anyone may take it at once. The token is kept."""
    lease = _require_owner(doc, "release")
    return doc.with_lease(replace(lease, owner_id=None, heartbeat_at=now, expires_at=now))


def check_poller_name(doc: StateDoc, poller_name: str) -> None:
    """An operator write must target the poller's own blob."""
    if doc.poller_name != poller_name:
        raise ValueError(f"state document for poller {doc.poller_name!r} cannot be written to {poller_name!r}")


def same_holder(a: Lease, b: Lease) -> bool:
    return a.owner_id is not None and a.owner_id == b.owner_id and a.fencing_token == b.fencing_token

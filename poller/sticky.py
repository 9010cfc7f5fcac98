"""The sticky lease: a process keeps a poller's lease (and its snapshot) between ticks.

Without it every tick acquires (a read and a write) and releases (a write): three storage
requests for a tick that finds nothing. With it the process that won the lease keeps the
:class:`~poller.lease.LeaseKeeper` — the state document and its ETag — in memory:

* a tick starts with no storage request while the lease has more than half its TTL left, and
  with one conditional write (a heartbeat on the cached ETag) when it has not; a heartbeat that
  times out while the lease still has time left does not fail the tick (the renewer retries);
* a tick that sends nothing writes nothing; a commit is one CAS on the cached ETag, as before;
* a CAS that fails (412: someone else wrote — a takeover after expiry, an operator's reset)
  drops the cached snapshot; the next start reloads and acts on what is stored (seed 002 §6:
  a live foreign lease is never taken, a free or lapsed one is taken with the token bumped);
* a tick that fails, or whose last commit is in doubt, gives the snapshot up (released when
  that is safe), so the next start reloads: what is stored is the truth;
* :meth:`StickyLease.release` on a graceful stop frees it for the next instance at once; after
  a crash the lease lapses after ``lease_ttl_seconds`` (plus the skew margin).
"""

from __future__ import annotations

import datetime as dt
import threading

from poller.lease import Clock, LeaseKeeper, utcnow
from poller.ports import StateStore
from shared.errors import LostLeaseError, StateUnavailableError
from shared.lease_margins import renew_interval
from shared.logs import get_logger, ids

__all__ = ["StickyLease"]

log = get_logger("poller.lease")


class StickyLease:
    """One poller's lease as held by this process across ticks (one tick at a time)."""

    def __init__(
        self, store: StateStore, owner_id: str, ttl: dt.timedelta, fingerprint: str, *, clock: Clock = utcnow
    ) -> None:
        self.store = store
        self.owner_id = owner_id
        self.ttl = ttl
        self.fingerprint = fingerprint
        self.clock = clock
        self._keeper: LeaseKeeper | None = None
        self._lock = threading.Lock()

    @property
    def held(self) -> LeaseKeeper | None:
        """The keeper kept from the last tick, if any (a view: no storage request)."""
        with self._lock:
            return self._keeper

    def take(self) -> LeaseKeeper | None:
        """The lease for this tick, or None when another owner holds it.

        The kept keeper costs nothing while more than half the TTL remains, one heartbeat CAS
        otherwise. A renewal that finds the blob changed (LostLeaseError) drops the cached
        snapshot and reloads at once. A renewal that fails (StateUnavailableError) while the lease
        has more than one renewer interval left hands the keeper to the tick, whose renewer
        retries. Other storage errors propagate (the snapshot is dropped first: the next take
        reloads, and recognises a lease that still names us).
        """
        with self._lock:
            keeper = self._keeper
            if keeper is not None:
                try:
                    keeper.heartbeat_if_due()
                    if keeper.settled:
                        return keeper
                except LostLeaseError:
                    log.info(
                        "the state blob changed since our last write; reloading",
                        extra=ids(poller=self.store.poller_name, window="W4", fencing_token=keeper.fencing_token),
                    )
                except StateUnavailableError as exc:
                    if keeper.time_left().total_seconds() <= renew_interval(self.ttl.total_seconds()):
                        self._keeper = None
                        raise
                    # One slow request: the lease still holds, and the tick's renewer retries (the
                    # next write first reloads, since this one may have landed).
                    log.warning(
                        "lease renewal failed; the tick goes on under the lease and retries it",
                        extra=ids(poller=self.store.poller_name, fencing_token=keeper.fencing_token, error=str(exc)),
                    )
                    return keeper
                except BaseException:
                    self._keeper = None
                    raise
                self._keeper = None
            snap = self.store.try_acquire(self.owner_id, self.ttl, self.fingerprint)
            if snap is None:
                return None
            self._keeper = LeaseKeeper(self.store, snap, self.ttl, clock=self.clock)
            return self._keeper

    def keep(self, keeper: LeaseKeeper) -> None:
        """After a tick: keep the snapshot for the next one when it is still certain, else drop it."""
        with self._lock:
            if keeper is self._keeper and not keeper.settled:
                self._keeper = None

    def drop(self, keeper: LeaseKeeper) -> None:
        """After a failed tick: release the lease (best effort) and forget the snapshot."""
        with self._lock:
            if keeper is self._keeper:
                self._keeper = None
        keeper.release()

    def release(self) -> None:
        """Graceful stop: give the lease up so another instance takes over at its next tick."""
        with self._lock:
            keeper, self._keeper = self._keeper, None
        if keeper is not None:
            keeper.release()
            log.info("lease released on shutdown", extra=ids(poller=self.store.poller_name))

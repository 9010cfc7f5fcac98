"""The lease's life in a process: the keeper of one tick, the lease kept across ticks.

The only module the tick (:mod:`poller.tick.lifecycle`) calls for the lease: it takes a :class:`TickLease`
at its start — :class:`StickyLease` (kept across ticks by a running app) or :class:`PerTickLease`
(acquired and released each tick) — works under the :class:`LeaseKeeper` it gets, and finishes
with it. Take, keep, renew, release and take-over are decided here and nowhere else; the pure
transitions each write sends are :mod:`poller.lease.protocol`'s, the renewer thread is
:mod:`poller.lease.renewer`'s.

* :class:`LeaseKeeper` holds the snapshot of one tick: commits extend the lease in the same
  write, heartbeats go out only when the remaining time runs low (R11; half the TTL, see
  :mod:`shared.lease_margins` for why two timed-out heartbeats still fit before expiry), and a
  background renewer stores a lost lease so the next commit refuses to write (seed case H).
* :class:`StickyLease` keeps the keeper between ticks, reloads after a failed CAS (a take-over),
  gives the lease up after a failed tick and releases it on a graceful stop.

About 480 lines, over R13's ~400, for a reason: the keeper's flags (lost, ambiguous, doubtful)
and the sticky lease that reads them between ticks are one state machine, and take, keep, renew
and release are decided in one module; the pure transitions (:mod:`poller.lease.protocol`) and
the renewer thread (:mod:`poller.lease.renewer`) are apart.
"""

from __future__ import annotations

import datetime as dt
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Literal, Protocol

from poller.lease.protocol import Clock, same_holder, utcnow
from poller.lease.renewer import RENEWALS
from poller.ports import Snapshot, StateStore
from shared.errors import (
    CommitAmbiguousError,
    CommitError,
    DbFanoutError,
    LostLeaseError,
    StateUnavailableError,
)
from shared.lease_margins import renew_interval, renew_threshold
from shared.logs import get_logger, ids
from shared.models import Checkpoint

__all__ = ["LeaseKeeper", "PerTickLease", "StickyLease", "TickLease"]

log = get_logger("poller.lease")


class LeaseKeeper:
    """The lease of one tick: the current snapshot, commits, heartbeats and release.

    **Threads and locks** (the one place these rules are written; :mod:`poller.tick.committer` and
    :mod:`poller.tick.lifecycle` follow them):

    * Three threads share a keeper: the *tick* (acquire, send, release; inline commits), the
      *committer* (commits and their W5 resolution when ``max_uncommitted_batches`` > 1) and the
      *renewer* (:meth:`heartbeat_if_due`; the process's one renewer thread serves every running
      tick's keeper, see :class:`~poller.lease.renewer.Renewals`).
    * One lock, the keeper's, guards the snapshot and the three flags below, and is held across
      every store call, so a heartbeat and a commit never race for the same ETag (a tick's own
      heartbeat may wait for a commit's request, at most the store's request timeout, and vice
      versa; the background renewer never waits: it skips a keeper whose lock is held, since the
      commit holding it extends the lease).
    * The renewer also takes the :class:`~poller.lease.renewer.Renewals` condition, never while holding a keeper's lock
      (it renews outside it), and a keeper's lock is never held while waiting on that condition.
    * The committer's condition guards only its own queue (pending, landed, error, closing); it
      is never held while a commit runs, so the two locks never nest and cannot deadlock.
    * The flags are set under the lock and every path checks them in one order, in
      :meth:`_ready`: **lost** (a LostLeaseError was seen: no write ever again; commit, heartbeat
      and resolve raise it, release returns), then **ambiguous** (a commit's outcome is unknown,
      W5: a commit refuses to write and a heartbeat skips until :meth:`resolve_ambiguous`
      decides; a release writes anyway, its CAS decides), then **doubtful** (a heartbeat's
      outcome is unknown: reload and adopt the stored ETag if the lease is still ours, before
      any write).
    * The committer's first failed write is stored and raised by the tick's next committer call
      (``submit``, ``wait_for_room``, ``flush``), which check the error before anything else.
    """

    def __init__(self, store: StateStore, snapshot: Snapshot, ttl: dt.timedelta, *, clock: Clock = utcnow) -> None:
        if snapshot.doc.lease.owner_id is None:
            raise ValueError("LeaseKeeper needs a snapshot that holds the lease (from try_acquire)")
        self._store = store
        self._snap = snapshot
        self._ttl = ttl
        self._renew_below = dt.timedelta(seconds=renew_threshold(ttl.total_seconds()))
        self._clock = clock
        self._lock = threading.RLock()
        self._lost: LostLeaseError | None = None
        self._ambiguous = False  # a commit may or may not have landed: our ETag is in doubt
        self._doubtful = False  # a heartbeat may or may not have landed: reload before writing

    # -- views ---------------------------------------------------------------------------------

    @property
    def snapshot(self) -> Snapshot:
        with self._lock:
            return self._snap

    @property
    def checkpoint(self) -> Checkpoint:
        return self.snapshot.doc.checkpoint

    @property
    def fencing_token(self) -> int:
        return self.snapshot.doc.lease.fencing_token

    @property
    def ttl(self) -> dt.timedelta:
        return self._ttl

    def time_left(self) -> dt.timedelta:
        """How long the lease lasts as this keeper last wrote or read it (negative once expired)."""
        with self._lock:
            expires_at = self._snap.doc.lease.expires_at
        return expires_at - self._clock() if expires_at is not None else dt.timedelta(0)

    @property
    def lost(self) -> LostLeaseError | None:
        """The LostLeaseError seen by a heartbeat or commit, if any."""
        with self._lock:
            return self._lost

    @property
    def settled(self) -> bool:
        """True while the snapshot is certain: the lease is not lost and no commit is in doubt."""
        with self._lock:
            return self._lost is None and not self._ambiguous

    def _ids(self, **more: object) -> dict[str, object]:
        doc = self._snap.doc
        return ids(poller=self._store.poller_name, fencing_token=doc.lease.fencing_token, **more)

    def check(self) -> None:
        """Raise the stored LostLeaseError (e.g. from the background renewer), if any."""
        with self._lock:
            if self._lost is not None:
                raise self._lost

    def _ready(self, op: Literal["commit", "heartbeat", "resolve", "release"]) -> bool:
        """Under the lock: the flags, in the one order every path checks them (class docstring).

        True: go on with ``op``; False: skip it (a heartbeat while a commit is in doubt).
        Raises the stored LostLeaseError, or CommitError for a commit while one is in doubt.
        """
        if self._lost is not None:
            raise self._lost
        if op == "resolve":
            return True  # its own reload settles both doubts
        if self._ambiguous and op == "heartbeat":
            return False  # the ETag is in doubt; resolve_ambiguous() decides
        if self._ambiguous and op == "commit":
            raise CommitError(
                "an earlier commit of this tick is unresolved; nothing was written",
                hint="call resolve_ambiguous() (or end the tick; the next one reloads the state)",
                window="W5",
            )
        self._reconcile_if_doubtful()
        return True

    # -- writes --------------------------------------------------------------------------------

    def commit(self, checkpoint: Checkpoint) -> Snapshot:
        """Write the checkpoint and extend the lease in the same CAS write.

        Raises LostLeaseError without writing when a heartbeat already lost the lease (case H).
        """
        with self._lock:
            self._ready("commit")
            try:
                self._snap = self._store.commit(self._snap, checkpoint, ttl=self._ttl)
            except LostLeaseError as exc:
                self._lost = exc
                raise
            except CommitAmbiguousError:
                self._ambiguous = True  # the write may have landed: our ETag is in doubt
                raise
            return self._snap

    def heartbeat_if_due(self, *, blocking: bool = True) -> bool:
        """Extend the lease when less than half the TTL remains (:mod:`shared.lease_margins`).
        True when a write went out.

        ``blocking=False``: skip (False) when a commit holds the keeper; it extends the lease itself.
        Raises LostLeaseError (stored for the next commit) or StateUnavailableError.
        """
        if not self._lock.acquire(blocking=blocking):
            return False
        try:
            return self._heartbeat_if_due_locked()
        finally:
            self._lock.release()

    def _heartbeat_if_due_locked(self) -> bool:
        """The body of :meth:`heartbeat_if_due`, under the keeper's lock."""
        if not self._ready("heartbeat"):
            return False
        expires_at = self._snap.doc.lease.expires_at
        if expires_at is not None and expires_at - self._clock() > self._renew_below:
            return False
        try:
            self._snap = self._store.heartbeat(self._snap, self._ttl)
        except LostLeaseError as exc:
            self._lost = exc
            raise
        except StateUnavailableError:
            self._doubtful = True  # a timed-out write may still have landed
            raise
        return True

    def _reconcile_if_doubtful(self) -> None:
        """After a heartbeat of unknown outcome: adopt the stored ETag if the lease is still ours."""
        if not self._doubtful:
            return
        stored = self._store.load()  # a read; raises StateUnavailableError and stays doubtful
        self._doubtful = False
        mine = self._snap.doc
        if stored is None or not same_holder(stored.doc.lease, mine.lease) or stored.doc.checkpoint != mine.checkpoint:
            self._lost = LostLeaseError("the lease moved while a heartbeat's outcome was unknown", window="W4")
            raise self._lost
        self._snap = stored

    def resolve_ambiguous(self, intended: Checkpoint) -> bool:
        """After CommitAmbiguousError: did the commit of ``intended`` land? (seed case G, W5)

        Reloads the state. True when it holds our owner, our fencing token and ``intended`` (the
        ETag is adopted); False when the write did not land and the lease is still ours. Raises
        LostLeaseError when the lease moved, and StateUnavailableError when storage is still down.
        """
        with self._lock:
            self._ready("resolve")
            stored = self._store.load()
            mine = self._snap.doc
            if stored is None or not same_holder(stored.doc.lease, mine.lease):
                self._lost = LostLeaseError("the lease moved while a commit's outcome was unknown", window="W4")
                raise self._lost
            if stored.doc.checkpoint == intended:
                landed = True
            elif stored.doc == mine:
                landed = False
            else:
                self._lost = LostLeaseError("the state changed under our lease (operator write?)", window="W4")
                raise self._lost
            self._snap = stored
            self._ambiguous = False
            self._doubtful = False
            log.info("ambiguous commit resolved", extra=self._ids(window="W5", landed=landed))
            return landed

    def release(self) -> None:
        """Give the lease up so the next tick (any instance) can take it at once. Never raises."""
        with self._lock:
            try:
                self._ready("release")
            except LostLeaseError:
                return  # not ours any more (whoever saw it logged it)
            except Exception as exc:  # the reload after a doubtful heartbeat failed
                log.warning("lease release skipped; it lapses after the TTL", extra=self._ids(error=repr(exc)))
                return
            try:
                self._snap = self._store.release(self._snap)
            except LostLeaseError:
                log.info("lease already taken over; nothing to release", extra=self._ids(window="W4"))
            except Exception as exc:  # best effort: the lease lapses by itself after the TTL
                log.warning("lease release failed; it lapses after the TTL", extra=self._ids(error=repr(exc)))

    # -- background renewal --------------------------------------------------------------------

    @contextmanager
    def renewing_in_background(self, interval: float | None = None) -> Iterator[LeaseKeeper]:
        """Run ``heartbeat_if_due`` every ``interval`` seconds (default TTL/10) while the body runs.

        A lost lease is stored (the next ``commit``/``check`` raises it) and ends the renewal;
        transient failures are logged and retried on the next interval. The renewals run on the
        process's one renewer thread (:class:`~poller.lease.renewer.Renewals`), not on a thread per tick.
        """
        period = interval if interval is not None else renew_interval(self._ttl.total_seconds())
        RENEWALS.add(self, period)
        try:
            yield self
        finally:
            RENEWALS.remove(self)  # returns once no heartbeat of this keeper is running

    def renew_once(self) -> bool:
        """One background renewal (never raises). False when the lease is lost: stop renewing it."""
        try:
            self.heartbeat_if_due(blocking=False)
        except LostLeaseError:
            log.warning("lease lost during the tick; the batch will not be committed", extra=self._ids(window="W4"))
            return False
        except DbFanoutError as exc:
            log.warning("heartbeat failed; retrying", extra=self._ids(error=str(exc)))
        except Exception as exc:  # a renewer must not die silently on an unexpected error
            log.exception("heartbeat crashed; retrying", extra=self._ids(error=repr(exc)))
        return True


# --------------------------------------------------------------------------------------------
# The lease's life across ticks: take, keep, renew (the keeper), release, take-over


class TickLease(Protocol):
    """What a tick asks of the lease (:func:`poller.tick.lifecycle.run_tick`): take it, then finish with it."""

    def take(self) -> LeaseKeeper | None:
        """The lease for this tick, or None when another owner holds it."""

    def finish(self, keeper: LeaseKeeper, *, failed: bool) -> None:
        """After the tick: keep, give up or release the lease. Never raises."""


class PerTickLease:
    """A lease taken at each tick's start and released at its end (one-shot runs, tests).

    Each tick costs an acquire (a read and a write) and a release (a write); a running app keeps
    its lease instead (:class:`StickyLease`).
    """

    def __init__(
        self, store: StateStore, owner_id: str, ttl: dt.timedelta, fingerprint: str, *, clock: Clock = utcnow
    ) -> None:
        self.store = store
        self.owner_id = owner_id
        self.ttl = ttl
        self.fingerprint = fingerprint
        self.clock = clock

    def take(self) -> LeaseKeeper | None:
        """Acquire (one CAS), or None when held elsewhere. Storage errors propagate."""
        snap = self.store.try_acquire(self.owner_id, self.ttl, self.fingerprint)
        return None if snap is None else LeaseKeeper(self.store, snap, self.ttl, clock=self.clock)

    def finish(self, keeper: LeaseKeeper, *, failed: bool) -> None:
        """Release (best effort; a lost lease is left alone): the next tick may take it at once."""
        keeper.release()


class StickyLease:
    """One poller's lease as held by this process across ticks (one tick at a time).

    Without it every tick acquires (a read and a write) and releases (a write): three storage
    requests for a tick that finds nothing. With it the process that won the lease keeps the
    :class:`LeaseKeeper` — the state document and its ETag — in memory:

    * a tick starts with no storage request while the lease has more than half its TTL left, and
      with one conditional write (a heartbeat on the cached ETag) when it has not; a heartbeat
      that times out while the lease still has time left does not fail the tick (the renewer
      retries);
    * a tick that sends nothing writes nothing; a commit is one CAS on the cached ETag, as before;
    * a CAS that fails (412: someone else wrote — a takeover after expiry, an operator's reset)
      drops the cached snapshot; the next start reloads and acts on what is stored (seed 002 §6:
      a live foreign lease is never taken, a free or lapsed one is taken with the token bumped);
    * a tick that fails, or whose last commit is in doubt, gives the snapshot up (released when
      that is safe), so the next start reloads: what is stored is the truth;
    * :meth:`release` on a graceful stop frees it for the next instance at once; after a crash the
      lease lapses after ``lease_ttl_seconds`` (plus the skew margin).

    ``on_not_owner`` runs (outside the lease's lock, never raising into it) whenever the process
    learns it does not hold the lease or gives it up: held elsewhere, lost, released, or a failed
    tick. The runtime closes the poller's LISTEN connection there (:mod:`poller.tick.wake`).
    """

    def __init__(
        self,
        store: StateStore,
        owner_id: str,
        ttl: dt.timedelta,
        fingerprint: str,
        *,
        clock: Clock = utcnow,
        on_not_owner: Callable[[], None] | None = None,
    ) -> None:
        self.store = store
        self.owner_id = owner_id
        self.ttl = ttl
        self.fingerprint = fingerprint
        self.clock = clock
        self._on_not_owner = on_not_owner
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
        try:
            with self._lock:
                keeper = self._take_locked()
        except BaseException:
            self._not_owner()  # may or may not hold it: the next take finds out
            raise
        if keeper is None:
            self._not_owner()
        return keeper

    def _take_locked(self) -> LeaseKeeper | None:
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

    def finish(self, keeper: LeaseKeeper, *, failed: bool) -> None:
        """After a tick: keep the lease, or give it up after a failure (:meth:`keep`, :meth:`drop`)."""
        if failed:
            self.drop(keeper)
        else:
            self.keep(keeper)
        if failed or keeper.lost is not None:
            self._not_owner()

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
        self._not_owner()

    def _not_owner(self) -> None:
        if self._on_not_owner is None:
            return
        try:
            self._on_not_owner()
        except Exception as exc:  # a hook must not turn a lease outcome into a failed tick
            log.warning("on_not_owner failed: %r", exc, extra=ids(poller=self.store.poller_name))

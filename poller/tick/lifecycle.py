"""One timer tick: the poller's lifecycle, in the order seed 001 §2 gives it.

**acquire** the lease (one CAS; the same read loads the checkpoint and refuses a foreign source
fingerprint; a process that kept its lease from the last tick reuses it; :mod:`poller.lease.keeper`
decides all of the lease's life, the tick only takes and finishes it)
→ up to ``max_batches_per_tick`` pages within the time budget: **fetch** →
**send** → **commit** (only after the sink accepted every message; the write also extends the
lease; :mod:`poller.tick.commits`) → **acknowledge** (the source's housekeeping once the tick's
last write landed) → **release** (unless the lease is kept for the next tick). :func:`run_tick`
reads in that order; :meth:`Tick.drain` is one drain's fetch → send → commit.

Commits run through :class:`~poller.tick.committer.Committer`: with ``max_uncommitted_batches`` > 1
the next page is fetched and sent while the previous commit is in flight, and one write covers
every page accepted meanwhile; a tick never ends (nor releases) before its last commit landed.

Failure branches name their window (W1-W7, see the operations guide). Ordinary outcomes (lease
held elsewhere, lease lost mid-tick, caught up, a broker refusing sends) are results; failures
that need attention raise after the lease was released. A refusing broker (queue full,
throttled, unreachable) is a state the sink's decorator keeps (:mod:`poller.tick.backoff`): the
tick backs off, keeps its checkpoint and its lease, and a tick inside the backoff window returns
before any request.
"""

from __future__ import annotations

import datetime as dt
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from poller.lease.keeper import LeaseKeeper, PerTickLease, TickLease
from poller.ports import SOURCE_NOTES, Page, Sink, Source, StateStore
from poller.tick.backoff import RefusalBackoff, SinkRefusals
from poller.tick.commits import Commits
from poller.tick.committer import Committer
from poller.tick.epochs import Order, page_batches
from poller.tick.events import page_batch
from poller.tick.prefetch import PageReader, Prefetcher, Sequential
from poller.tick.stage import stage
from poller.tick.wake import Waker
from shared.config import PollerConfig
from shared.errors import BrokerRefusingError, LostLeaseError
from shared.logs import get_logger, ids
from shared.models import Batch, Checkpoint, Position
from shared.telemetry import metrics, recording

__all__ = ["IDLE_BACKOFF", "LINGER_MARGIN", "Tick", "TickResult", "default_owner_id", "run_tick"]

log = get_logger("poller.tick")

StopReason = Literal["caught_up", "max_batches", "time_budget", "lease_held", "lease_lost", "sink_refusing"]

#: A lingering tick ends this long before the timer's next occurrence (seconds): a timer whose
#: function still runs when it is due skips that occurrence. A tick's end after its last page
#: (the last commit, the reader thread's join, the slot's advance) took 50-140 ms on a busy
#: two-core host (issue 41), and each miss costs a whole period without a tick.
LINGER_MARGIN = 0.25
#: An idle linger polls at most this many times less often than ``poll_interval_ms``.
IDLE_BACKOFF = 4
#: The drains a linger follows: caught up, or stopped at ``max_batches_per_tick`` with more to
#: read (a backlog, a snapshot's chunks); not the time budget (the lease's safety margin).
LINGERS_AFTER: tuple[StopReason, ...] = ("caught_up", "max_batches")


@dataclass(frozen=True, slots=True)
class TickResult:
    """What a tick did. ``rows``/``batches`` count only what was sent *and* committed."""

    poller: str
    stop_reason: StopReason
    rows: int = 0
    batches: int = 0
    fencing_token: int | None = None
    skipped_null_cursors: int = 0


def default_owner_id() -> str:
    """Who we are in the lease: the Functions instance (or host) plus a per-process nonce."""
    instance = os.environ.get("WEBSITE_INSTANCE_ID", socket.gethostname())[:40]
    return f"{instance}/{os.getpid()}/{uuid.uuid4().hex[:8]}"


def _utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def run_tick(
    poller: PollerConfig,
    source: Source,
    store: StateStore,
    sink: Sink,
    *,
    owner_id: str | None = None,
    clock: Callable[[], dt.datetime] = _utcnow,
    monotonic: Callable[[], float] = time.monotonic,
    lease: TickLease | None = None,
    next_occurrence: dt.datetime | None = None,
    stop: threading.Event | None = None,
    waker: Waker | None = None,
    refusals: SinkRefusals | None = None,
) -> TickResult:
    """Run one tick of ``poller``. Raises the typed error of a failed step (after releasing).

    ``lease``: the process's :class:`~poller.lease.keeper.StickyLease` (kept across ticks; without
    it the tick acquires and releases its own). ``next_occurrence``, ``stop`` and ``waker`` bound
    and wake a lingering tick (:meth:`Tick.linger`). ``refusals`` carries a refusing broker's
    backoff across ticks, wrapped around ``sink`` (:class:`~poller.tick.backoff.RefusalBackoff`):
    a tick inside its window returns ``sink_refusing`` at once. Without it each tick starts afresh.
    """
    sending = RefusalBackoff(
        sink, refusals or SinkRefusals(poller.name, monotonic=monotonic, clock=clock), monotonic=monotonic
    )
    tick = Tick(poller, source, sending, clock, monotonic, stop=stop, waker=waker)
    until = tick.linger_deadline(next_occurrence)
    if not sending.backoff_over(until, tick.stop):
        return TickResult(poller.name, "sink_refusing")
    ttl = dt.timedelta(seconds=poller.lease_ttl_seconds)
    lease = lease or PerTickLease(store, owner_id or default_owner_id(), ttl, source.fingerprint, clock=clock)
    keeper = tick.take(lease, until)  # acquire
    if keeper is None:
        return TickResult(poller.name, "lease_held")
    failed = True
    try:
        # A slow fetch or send must not let the lease lapse: heartbeat in the background (R11).
        # It writes only when half the TTL is left; commits extend the lease as they land.
        with keeper.renewing_in_background(), source.pinned():
            result = tick.drain_or_back_off(keeper, until)  # fetch -> send -> commit, page by page
            if until is not None and result.stop_reason in LINGERS_AFTER:
                result = tick.linger(keeper, result, until)
        tick.finished(keeper, result)  # acknowledge; the end of a refusal; lag
        failed = False
        return result
    except LostLeaseError:
        failed = False  # nothing to release: the lease is someone else's
        return tick.lost(keeper)
    except BrokerRefusingError as refused:
        failed = False  # a state, not a failure: keep the lease (no release, no re-acquire per attempt)
        tick.refused(keeper, refused)
        return TickResult(poller.name, "sink_refusing", fencing_token=keeper.fencing_token)
    finally:
        lease.finish(keeper, failed=failed)  # a failed tick gives the lease up (the next one reloads)


@dataclass(slots=True)
class _Drained:
    """Where one drain's pages stopped: the reason, the last accepted page's end, the source's notes,
    the order epoch, a position an empty page still moves the checkpoint to (Page.advance), and the
    NULL cursors it skipped."""

    position: Position | None
    notes: Mapping[str, Any]  # the source's notes every checkpoint carries on (Page.notes)
    order: Order  # the epoch and last cursor sent (poller.tick.epochs), carried on the same way
    reason: StopReason = "max_batches"
    moved: Position | None = None
    nulls: int = 0


class Tick:
    """The steps of one tick, with what they share bound once: the poller, its source's
    fingerprint, the sink (wrapped in its refusal backoff) and the clocks."""

    def __init__(
        self,
        poller: PollerConfig,
        source: Source,
        sink: RefusalBackoff,
        clock: Callable[[], dt.datetime] = _utcnow,
        monotonic: Callable[[], float] = time.monotonic,
        *,
        stop: threading.Event | None = None,
        waker: Waker | None = None,
    ) -> None:
        self.poller = poller
        self.stop = stop or threading.Event()
        self.waker = waker
        self.name = poller.name
        self.source = source
        self.sink = sink
        self.fingerprint = source.fingerprint
        self.clock = clock
        self.monotonic = monotonic
        self.commits = Commits(poller, source, clock)

    # -- the lifecycle, in order -------------------------------------------------------------

    def take(self, lease: TickLease, until: float | None = None) -> LeaseKeeper | None:
        """Take the lease (a kept one costs no storage request while it has time left), or None
        when another owner holds it (an outcome, not an error). Tells the sink's backoff what the
        lease says, and listens for commits before the first fetch of a lingering tick (``until``)."""
        log.debug("tick started", extra=ids(poller=self.name))
        with stage("acquire", self.name):
            keeper = lease.take()
        if keeper is None:
            log.debug("lease held elsewhere; skipping tick", extra=ids(poller=self.name))
            self.sink.lease_taken(None)  # the holder sends (and backs off) for this poller now
            _forget(self.source)
            return None
        self.sink.lease_taken(keeper.checkpoint)  # adopts a refusal another process persisted
        if until is not None and self.waker is not None:
            self.waker.listen()  # before the first fetch: a commit in between still wakes the linger
        return keeper

    def drain(self, keeper: LeaseKeeper, until: float | None = None) -> TickResult:
        """Fetch, send and commit pages until caught up, out of pages or out of time (the time
        budget, or ``until``: a lingering tick's end, so a long drain does not run into the timer's
        next occurrence, which the host would skip)."""
        began = self.monotonic()
        deadline = began + self.poller.time_budget_seconds
        if until is not None:
            deadline = min(deadline, until)
        committer: Committer[Checkpoint] = Committer(
            lambda checkpoint: self.commits.commit(keeper, checkpoint),
            self.poller.max_uncommitted_batches,
            name=f"committer-{self.name}",
        )
        checkpoint = keeper.checkpoint  # the next page starts after the last *accepted* one
        drained = _Drained(
            checkpoint.position, checkpoint.metadata.get(SOURCE_NOTES) or {}, Order.of(checkpoint.metadata)
        )
        pages = self._reader(drained.position, deadline)
        try:
            self._send_pages(pages, committer, drained, deadline, began)
            landed = committer.flush()
            if drained.moved is not None and drained.moved != drained.position:  # nothing to send: one write
                moved = self.commits.moved(keeper, drained.moved, drained.notes, drained.order)
                self.commits.commit(keeper, moved)
        except Exception as failure:
            self.commits.land_accepted(committer, keeper, failure)
            raise
        finally:
            pages.close()
            committer.close()
        return TickResult(self.name, drained.reason, landed.rows, landed.batches, keeper.fencing_token, drained.nulls)

    def _send_pages(
        self, pages: PageReader, committer: Committer[Checkpoint], drained: _Drained, deadline: float, began: float
    ) -> None:
        """The drain's loop: fetch a page, send it, submit its checkpoint (``drained`` says where it stopped).

        It starts no page it expects to end past ``deadline`` (the last page's time as the guess): a
        lingering tick that ends after the timer's next occurrence makes the host skip that
        occurrence, a second without a tick (issue 41)."""
        poller, last = self.poller, began
        for _ in range(poller.max_batches_per_tick):
            page = pages.next()
            drained.nulls = max(drained.nulls, page.skipped_null_cursors)
            if page.notes is not None:
                drained.notes = page.notes(drained.notes)
            if not len(page):
                drained.moved, drained.reason = page.advance, "caught_up"
                return
            # One batch per order epoch the page spans (nearly always one), computed from the
            # committed checkpoint's order on: a page read again gets the same epochs.
            batches, drained.order = page_batches(
                poller, self.fingerprint, page, page_batch(poller, self.fingerprint, page), drained.order
            )
            committer.wait_for_room()  # at most max_uncommitted_batches sent ahead of the checkpoint
            for batch in batches:
                self.send(batch)
            committer.submit(self.commits.after(batches[-1], page, drained.notes, drained.order), len(page))
            drained.position = page.end
            if page.caught_up(poller.batch_size):
                drained.reason = "caught_up"
                return
            now = self.monotonic()
            if now + (now - last) >= deadline:
                drained.reason = "time_budget"
                return
            last = now

    def drain_or_back_off(self, keeper: LeaseKeeper, until: float | None) -> TickResult:
        """A :meth:`drain`; in a lingering tick (``until`` set) a refusing broker is waited out
        within the linger: after the backoff window the result says ``max_batches`` (rows wait:
        the linger drains again at once), or ``sink_refusing`` when the window outlasts the linger.
        Without ``until`` the refusal propagates (:func:`run_tick` backs off across ticks)."""
        if until is None:
            return self.drain(keeper)
        try:
            return self.drain(keeper, until)
        except BrokerRefusingError as refused:
            self.refused(keeper, refused)
            reason: StopReason = "max_batches" if self.sink.backoff_over(until, self.stop) else "sink_refusing"
            return TickResult(self.name, reason, fencing_token=keeper.fencing_token)

    def linger_deadline(self, next_occurrence: dt.datetime | None) -> float | None:
        """When a lingering tick must end (on ``monotonic``), or None when it must not linger:
        ``linger_seconds`` after its start or :data:`LINGER_MARGIN` before ``next_occurrence`` (the
        timer's next firing, when known), whichever comes first."""
        budget = self.poller.linger_seconds
        if budget <= 0:
            return None
        if next_occurrence is not None:  # end before the timer fires again, or it skips a firing
            budget = min(budget, (next_occurrence - self.clock()).total_seconds() - LINGER_MARGIN)
        return self.monotonic() + budget if budget > 0 else None

    def linger(self, keeper: LeaseKeeper, caught_up: TickResult, until: float) -> TickResult:
        """After a drain (caught up, or at ``max_batches_per_tick``): poll again until ``until``,
        sending what appears (opt-in linger).

        Polls every ``poll_interval_ms``, doubling the wait after each empty poll up to
        :data:`IDLE_BACKOFF` times it, and back to it as soon as a poll finds rows. After a drain
        that stopped at ``max_batches_per_tick`` (more rows are known to be there: a backlog, a
        snapshot's chunks) the next one starts at once, without waiting for the interval or a
        notification: a live change committed meanwhile waits for a page, not for the next timer.
        Each poll is a :meth:`drain` under the same lease (commits as usual; the background renewer
        keeps the lease alive). A refusing broker is waited out inside the linger
        (:meth:`drain_or_back_off`). Ends early on ``stop``, a lost lease (raised, like a drain's)
        or a backoff window that outlasts the linger.
        """
        base = self.poller.poll_interval_ms / 1000
        interval, rows, batches, nulls = base, caught_up.rows, caught_up.batches, caught_up.skipped_null_cursors
        reason: StopReason = caught_up.stop_reason
        while (remaining := until - self.monotonic()) > 0:
            if reason == "max_batches":
                if self.stop.is_set():
                    break
            elif not self._wait(min(interval, remaining), remaining):
                if self.stop.is_set():
                    break
                continue  # notify: nothing committed, so no query
            keeper.check()  # the renewer saw the lease go: stop before fetching for someone else
            result = self.drain_or_back_off(keeper, until)
            rows, batches = rows + result.rows, batches + result.batches
            nulls, reason = max(nulls, result.skipped_null_cursors), result.stop_reason
            interval = base if result.rows else min(interval * 2, base * IDLE_BACKOFF)
            if reason == "sink_refusing":
                break  # the broker's backoff window outlasts the linger: the next tick retries
        return TickResult(self.name, reason, rows, batches, keeper.fencing_token, nulls)

    def _wait(self, interval: float, remaining: float) -> bool:
        """Wait before the next poll: True to poll now, False to skip it (stopped, or no notification).

        Polling: the interval (or until stopped). A waker (notify, wal): until it sees a commit, in
        slices of at most a second so a stop is seen; polls at the interval while it is down.
        """
        if self.waker is None or not self.waker.ready:
            return not self.stop.wait(interval)
        return self.waker.wait(min(remaining, 1.0)) and not self.stop.is_set()

    def _reader(self, first: Position | None, deadline: float) -> PageReader:
        """Pages read one ahead on their own thread where the source allows it (keyset queries, no
        side effects) and the poller does not ask for the strict order (max_uncommitted_batches = 1)."""
        poller = self.poller
        if getattr(self.source, "prefetch_pages", False) is True and poller.max_uncommitted_batches > 1:
            return Prefetcher(
                self.fetch,
                first,
                limit=poller.batch_size,
                max_pages=poller.max_batches_per_tick,
                pinned=self.source.pinned,
                name=self.name,
                reads_on=getattr(self.source, "reads_on", lambda _page: True),
                deadline=deadline,
                clock=self.monotonic,
            )
        return Sequential(self.fetch, first)

    def fetch(self, after: Position | None) -> Page:
        """The next keyset page after ``after``."""
        with stage("fetch", self.name):
            page = self.source.fetch(after, self.poller.batch_size)
        metrics.rows_fetched.add(len(page), {"poller": self.name})
        return page

    def send(self, batch: Batch) -> None:
        """Hand the batch to the sink; returns only when every message was accepted."""
        with stage("send", self.name):
            self.sink.send(batch)
        log.info("batch enqueued", extra=ids(poller=self.name, batch_id=batch.batch_id, events=len(batch.events)))

    def refused(self, keeper: LeaseKeeper, refused: BrokerRefusingError) -> None:
        """The broker refused a send: back off; a refusal that starts here is written to the state
        blob once (``checkpoint.metadata``, same position) for ``dbfanout status`` and other processes."""
        marked = self.sink.refused(refused, keeper.checkpoint)
        if marked is not None:
            self.commits.mark(keeper, marked)

    def finished(self, keeper: LeaseKeeper, result: TickResult) -> None:
        """After the tick's last write: the source's housekeeping, the end of a refusal whose
        sends were accepted again, and the backlog left (a count only when the metric is exported)."""
        self.commits.acknowledge(keeper.checkpoint)
        self.sink.tick_ended(caught_up=result.stop_reason == "caught_up")
        if recording():  # a count query only when the metric is exported, and only when behind
            self.commits.observe_lag_rows(result.stop_reason, keeper.checkpoint)

    def lost(self, keeper: LeaseKeeper) -> TickResult:
        """The lease went to another owner mid-tick: an outcome (the new owner re-sends the batch)."""
        _forget(self.source)
        log.warning(
            "lease lost mid-tick; the new owner re-sends the batch",
            extra=ids(poller=self.name, window="W4", fencing_token=keeper.fencing_token),
        )
        return TickResult(self.name, "lease_lost", fencing_token=keeper.fencing_token)


def _forget(source: Source) -> None:
    """The lease is another process's: a source drops what it keeps locally for its next fetches
    (pg_logical: the spool of a huge transaction)."""
    forget = getattr(source, "forget", None)
    if callable(forget):
        forget()

"""One timer tick: the poller's lifecycle, in the order seed 001 §2 gives it.

**acquire** the lease (one CAS; the same read loads the checkpoint and refuses a foreign source
fingerprint; a process that kept its lease from the last tick reuses it; :mod:`poller.lease.keeper`
decides all of the lease's life, the tick only takes and finishes it)
→ up to ``max_batches_per_tick`` pages within the time budget: **fetch** →
**send** → **commit** (only after the sink accepted every message; the write also extends the
lease) → **acknowledge** (the source's housekeeping once the tick's last write landed) →
**release** (unless the lease is kept for the next tick). :class:`Tick` has one method per
step, in that order.

Commits run through :class:`~poller.tick.committer.Committer`: with ``max_uncommitted_batches`` > 1
the next page is fetched and sent while the previous commit is in flight, and one write covers
every page accepted meanwhile; a tick never ends (nor releases) before its last commit landed.
What must follow each landed write (log, metrics) is in :meth:`Tick.committed`: once per landed
write, in order, on the thread that wrote it; what may wait for the tick's last one, in
:meth:`Tick.acknowledge`.

Failure branches name their window (W1-W7, see the operations guide). Ordinary outcomes (lease
held elsewhere, lease lost mid-tick, caught up, a broker refusing sends) are results; failures
that need attention raise after the lease was released. A refusing broker (queue full,
throttled, unreachable) is a state :mod:`poller.tick.backoff` keeps: the tick backs off, keeps its
checkpoint and its lease, and a tick inside the backoff window returns before any request.
"""

from __future__ import annotations

import datetime as dt
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any, Literal
from zoneinfo import ZoneInfo

from poller.lease.keeper import LeaseKeeper, PerTickLease, TickLease
from poller.ports import CountsPending, Page, Sink, Source, StateStore
from poller.tick.backoff import METADATA_KEY, SinkRefusals
from poller.tick.committer import Committer
from poller.tick.events import page_batch
from poller.tick.prefetch import PageReader, Prefetcher, Sequential
from poller.tick.wake import Waker
from shared.config import PollerConfig
from shared.errors import BrokerRefusingError, CommitAmbiguousError, CommitError, DbFanoutError, LostLeaseError
from shared.logs import get_logger, ids
from shared.models import Batch, Checkpoint, Position
from shared.telemetry import metrics, recording

__all__ = ["IDLE_BACKOFF", "LAG_ROWS_LIMIT", "LINGER_MARGIN", "Tick", "TickResult", "default_owner_id", "run_tick"]

log = get_logger("poller.tick")

StopReason = Literal["caught_up", "max_batches", "time_budget", "lease_held", "lease_lost", "sink_refusing"]

#: A lingering tick ends this long before the timer's next occurrence (seconds): a timer whose
#: function still runs when it is due skips that occurrence.
LINGER_MARGIN = 0.1
#: ``dbfanout.lag_rows`` counts a backlog up to this many rows: one bounded count per tick that stops short.
LAG_ROWS_LIMIT = 10_000
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

    With ``lease`` (the process's :class:`~poller.lease.keeper.StickyLease` for this poller) the lease
    and its snapshot are kept for the next tick instead of being released: a tick that finds
    nothing costs no storage request. Without it the tick acquires and releases its own lease
    (:class:`~poller.lease.keeper.PerTickLease`).

    With ``linger_seconds`` set, a tick that caught up (or sent its ``max_batches_per_tick`` pages
    with more to read) keeps polling (:meth:`Tick.linger`) until
    ``linger_seconds`` after its start or :data:`LINGER_MARGIN` before ``next_occurrence`` (the
    timer's next firing, when known), whichever comes first; ``stop`` cuts it short (shutdown).
    With ``waker`` (``wake = "notify"`` or ``"wal"``) the linger waits for a sign of a commit instead
    of polling; it listens before the tick's first fetch, so a commit in between is not missed.

    ``refusals`` (the process's :class:`~poller.tick.backoff.SinkRefusals` for this poller) carries a
    refusing broker's backoff across ticks: a tick inside its window returns ``sink_refusing``
    at once (a lingering one waits the window out when it ends in time). Without it each tick
    starts with no backoff.
    """
    refusals = refusals or SinkRefusals(poller.name, monotonic=monotonic, clock=clock)
    tick = Tick(poller, source, sink, clock, monotonic, stop=stop, waker=waker, refusals=refusals)
    linger_until = tick.linger_deadline(next_occurrence)
    if not tick.backoff_over(linger_until):
        return TickResult(poller.name, "sink_refusing")
    if lease is None:
        ttl = dt.timedelta(seconds=poller.lease_ttl_seconds)
        lease = PerTickLease(store, owner_id or default_owner_id(), ttl, source.fingerprint, clock=clock)
    keeper = tick.take(lease)
    if keeper is None:
        refusals.forget()  # the holder sends (and backs off) for this poller now
        _forget(source)
        return TickResult(poller.name, "lease_held")
    refusals.adopt(keeper.checkpoint.metadata)
    _source_notes(source, keeper.checkpoint.metadata)
    if linger_until is not None and waker is not None:
        waker.listen()  # before the first fetch: a commit in between still wakes the linger
    failed = True
    try:
        # A slow fetch or send must not let the lease lapse: heartbeat in the background (R11).
        # It writes only when half the TTL is left; commits extend the lease as they land.
        with keeper.renewing_in_background(), source.pinned():
            result = tick.drain_or_back_off(keeper, linger_until)
            if linger_until is not None and result.stop_reason in LINGERS_AFTER:
                result = tick.linger(keeper, result, linger_until)
        tick.acknowledge(keeper.checkpoint)
        refusals.tick_ended(caught_up=result.stop_reason == "caught_up")
        if recording():  # a count query only when the metric is exported, and only when behind
            tick.observe_lag_rows(result, keeper.checkpoint)
        failed = False
        return result
    except LostLeaseError:
        failed = False  # nothing to release: the lease is someone else's
        _forget(source)
        log.warning(
            "lease lost mid-tick; the new owner re-sends the batch",
            extra=ids(poller=poller.name, window="W4", fencing_token=keeper.fencing_token),
        )
        return TickResult(poller.name, "lease_lost", fencing_token=keeper.fencing_token)
    except BrokerRefusingError as refused:
        failed = False  # a state, not a failure: keep the lease (no release, no re-acquire per attempt)
        tick.refused(keeper, refused)
        return TickResult(poller.name, "sink_refusing", fencing_token=keeper.fencing_token)
    finally:
        lease.finish(keeper, failed=failed)  # a failed tick gives the lease up (the next one reloads)


class Tick:
    """The steps of one tick, with what they share bound once: the poller, its source's
    fingerprint, the sink and the clocks."""

    def __init__(
        self,
        poller: PollerConfig,
        source: Source,
        sink: Sink,
        clock: Callable[[], dt.datetime] = _utcnow,
        monotonic: Callable[[], float] = time.monotonic,
        *,
        stop: threading.Event | None = None,
        waker: Waker | None = None,
        refusals: SinkRefusals | None = None,
    ) -> None:
        self.poller = poller
        self.refusals = refusals or SinkRefusals(poller.name, monotonic=monotonic, clock=clock)
        self.stop = stop or threading.Event()
        self.waker = waker
        self.name = poller.name
        self.source = source
        self.sink = sink
        self.fingerprint = source.fingerprint
        self.clock = clock
        self.monotonic = monotonic
        self._cursor_tz = ZoneInfo(poller.cursor_timezone) if poller.cursor_timezone else None

    # -- the lifecycle, in order -------------------------------------------------------------

    def take(self, lease: TickLease) -> LeaseKeeper | None:
        """Take the lease (a kept one costs no storage request while it has time left), or None
        when another owner holds it (an outcome, not an error)."""
        log.debug("tick started", extra=ids(poller=self.name))
        with _stage("acquire", self.name):
            keeper = lease.take()
        if keeper is None:
            log.debug("lease held elsewhere; skipping tick", extra=ids(poller=self.name))
        return keeper

    def drain(self, keeper: LeaseKeeper, until: float | None = None) -> TickResult:
        """Fetch, send and commit pages until caught up, out of pages or out of time (the time
        budget, or ``until``: a lingering tick's end, so a long drain does not run into the timer's
        next occurrence, which the host would skip)."""
        poller = self.poller
        deadline = self.monotonic() + poller.time_budget_seconds
        if until is not None:
            deadline = min(deadline, until)
        nulls = 0
        reason: StopReason = "max_batches"
        position = keeper.checkpoint.position  # where the next page starts: after the last *accepted* one
        committer: Committer[Checkpoint] = Committer(
            lambda checkpoint: self.commit(keeper, checkpoint),
            poller.max_uncommitted_batches,
            name=f"committer-{self.name}",
        )
        pages = self._reader(position)
        moved: Position | None = None  # a position an empty page must still checkpoint (Page.advance)
        try:
            for _ in range(poller.max_batches_per_tick):
                page = pages.next()
                nulls = max(nulls, page.skipped_null_cursors)
                if not len(page):
                    moved = page.advance
                    reason = "caught_up"
                    break
                batch = page_batch(poller, self.fingerprint, page)
                committer.wait_for_room()  # at most max_uncommitted_batches sent ahead of the checkpoint
                self.send(batch)
                committer.submit(self.checkpoint_after(batch, page), len(page))
                position = page.end
                if page.caught_up(poller.batch_size):
                    reason = "caught_up"
                    break
                if self.monotonic() >= deadline:
                    reason = "time_budget"
                    break
            landed = committer.flush()
            if moved is not None and moved != position:
                self.commit(keeper, self.checkpoint_moved(keeper, moved))  # nothing to send: one write
        except Exception as failure:
            self._land_accepted(committer, keeper, failure)
            raise
        finally:
            pages.close()
            committer.close()
        return TickResult(self.name, reason, landed.rows, landed.batches, keeper.fencing_token, nulls)

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
            reason: StopReason = "max_batches" if self.backoff_over(until) else "sink_refusing"
            return TickResult(self.name, reason, fencing_token=keeper.fencing_token)

    def linger_deadline(self, next_occurrence: dt.datetime | None) -> float | None:
        """When a lingering tick must end (on ``monotonic``), or None when it must not linger."""
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

    def _reader(self, first: Position | None) -> PageReader:
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
            )
        return Sequential(self.fetch, first)

    def fetch(self, after: Position | None) -> Page:
        """The next keyset page after ``after``."""
        with _stage("fetch", self.name):
            page = self.source.fetch(after, self.poller.batch_size)
        metrics.rows_fetched.add(len(page), {"poller": self.name})
        return page

    def send(self, batch: Batch) -> None:
        """Hand the batch to the sink; returns only when every message was accepted."""
        with _stage("send", self.name):
            self.sink.send(batch)
        self.refusals.accepted(len(batch.events))
        log.info("batch enqueued", extra=ids(poller=self.name, batch_id=batch.batch_id, events=len(batch.events)))

    def backoff_over(self, until: float | None) -> bool:
        """Whether a send may be tried now: no backoff, or its window ended (a lingering tick,
        ``until`` its end, waits for the window when it ends first; a stop cuts the wait)."""
        wait = self.refusals.wait_seconds()
        if wait <= 0:
            return True
        if until is None or self.monotonic() + wait >= until:
            keys = ids(poller=self.name, retry_in_seconds=round(wait, 1))
            log.debug("the broker refuses sends; backing off", extra=keys)
            return False
        return not self.stop.wait(wait)

    def refused(self, keeper: LeaseKeeper, refused: BrokerRefusingError) -> None:
        """The broker refused a send: back off; a refusal that starts here is written to the state
        blob once (``checkpoint.metadata``, same position) for ``dbfanout status`` and other processes."""
        if not self.refusals.refused(refused):
            return
        checkpoint = keeper.checkpoint
        marked = Checkpoint(
            position=checkpoint.position,
            last_successful_batch_id=checkpoint.last_successful_batch_id,
            updated_at=checkpoint.updated_at,
            metadata={**checkpoint.metadata, METADATA_KEY: self.refusals.metadata()},
        )
        try:
            with _stage("commit", self.name):
                keeper.commit(marked)
        except Exception as exc:  # the state is for status only: backing off does not depend on it
            log.warning("could not record the refusal in the state blob: %r", exc, extra=ids(poller=self.name))

    def checkpoint_after(self, batch: Batch, page: Page) -> Checkpoint:
        """The checkpoint past ``page`` (to write once the sink accepted it)."""
        end = page.end
        assert end is not None
        return Checkpoint(
            position=end,
            last_successful_batch_id=batch.batch_id,
            updated_at=self.clock(),
            metadata={"row_count": len(page), **_source_notes(self.source)},
        )

    def checkpoint_moved(self, keeper: LeaseKeeper, position: Position) -> Checkpoint:
        """The checkpoint at ``position`` with no row sent (a source state change no row carries)."""
        return Checkpoint(
            position=position,
            last_successful_batch_id=keeper.checkpoint.last_successful_batch_id,
            updated_at=self.clock(),
            metadata={"row_count": 0, **_source_notes(self.source)},
        )

    def commit(self, keeper: LeaseKeeper, checkpoint: Checkpoint) -> None:
        """Write ``checkpoint`` — only ever after the sink accepted every page up to it."""
        batch_id = checkpoint.last_successful_batch_id
        try:
            with _stage("commit", self.name):
                keeper.commit(checkpoint)
        except CommitAmbiguousError:
            # W5: the write may have landed. Reload: if it did, go on; if not, the pages are re-sent.
            if not keeper.resolve_ambiguous(checkpoint):
                log.warning(
                    "ambiguous commit did not land; the batch will be re-sent",
                    extra=ids(poller=self.name, batch_id=batch_id, window="W5"),
                )
                raise
            log.info("ambiguous commit had landed", extra=ids(poller=self.name, batch_id=batch_id))
        except CommitError:
            log.warning(
                "checkpoint commit failed; the batch will be re-sent",
                extra=ids(poller=self.name, batch_id=batch_id, window="W1"),
            )
            raise
        self.committed(keeper, checkpoint)

    def committed(self, keeper: LeaseKeeper, checkpoint: Checkpoint) -> None:
        """After a landed write: log, metrics. The place for steps that must follow a commit."""
        log.info(
            "checkpoint committed",
            extra=ids(
                poller=self.name, batch_id=checkpoint.last_successful_batch_id, fencing_token=keeper.fencing_token
            ),
        )
        attrs = {"poller": self.name}
        now = checkpoint.updated_at or _utcnow()
        metrics.last_success_timestamp.record(now.timestamp(), attrs)
        lag = self._lag_seconds(checkpoint, now)
        if lag is not None:
            metrics.lag_seconds.record(lag, attrs)

    def acknowledge(self, checkpoint: Checkpoint) -> None:
        """Tell the source what landed (it may prune or advance); its failure never fails the tick."""
        if checkpoint.position is None:
            return
        try:
            with _stage("acknowledge", self.name):
                self.source.acknowledge(checkpoint)
        except Exception as exc:
            log.warning("source housekeeping after the commit failed: %r", exc, extra=ids(poller=self.name))

    def observe_lag_rows(self, result: TickResult, checkpoint: Checkpoint) -> None:
        """``dbfanout.lag_rows``: 0 when the tick caught up (no query), else the rows still after
        the checkpoint, counted up to :data:`LAG_ROWS_LIMIT`; sources that cannot count are skipped."""
        if not isinstance(self.source, CountsPending):
            return
        attrs = {"poller": self.name}
        if result.stop_reason == "caught_up":
            metrics.lag_rows.record(0, attrs)
            return
        if result.stop_reason not in ("max_batches", "time_budget"):
            return
        try:
            pending = self.source.pending_rows(checkpoint.position, LAG_ROWS_LIMIT)
        except Exception as exc:  # a metric never fails a tick that landed
            log.warning("could not count the rows still to send: %r", exc, extra=ids(poller=self.name))
            return
        metrics.lag_rows.record(pending, attrs)

    # -- helpers -------------------------------------------------------------------------------

    def _land_accepted(self, committer: Committer[Checkpoint], keeper: LeaseKeeper, failure: Exception) -> None:
        """After a failed step: land what the sink already accepted (fewer re-sends).

        Never raises (``failure`` is what propagates), but says when the pages stay uncommitted.
        """
        try:
            committer.flush()
        except Exception as exc:
            if exc is failure:
                return  # the failure *was* this commit's: it propagates, and commit() logged it
            window = exc.window if isinstance(exc, DbFanoutError) else None
            log.warning(
                "could not commit the pages the sink already accepted; they will be re-sent",
                extra=ids(
                    poller=self.name,
                    batch_id=committer.last_submitted.last_successful_batch_id if committer.last_submitted else None,
                    fencing_token=keeper.fencing_token,
                    window=window or "W1",
                    error=str(exc) if isinstance(exc, DbFanoutError) else repr(exc),
                    failure=type(failure).__name__,
                ),
            )

    def _lag_seconds(self, checkpoint: Checkpoint, now: dt.datetime) -> float | None:
        """How far the checkpoint's cursor is behind ``now``, for a temporal cursor."""
        cursor = checkpoint.position.cursor if checkpoint.position is not None else None
        if isinstance(cursor, str):  # SQLite stores timestamps as text
            with suppress(ValueError):
                cursor = dt.datetime.fromisoformat(cursor)
        if not isinstance(cursor, dt.datetime):
            return None
        if cursor.tzinfo is None:
            if self._cursor_tz is None:
                return None
            cursor = cursor.replace(tzinfo=self._cursor_tz)
        return max(0.0, (now - cursor).total_seconds())


def _forget(source: Source) -> None:
    """The lease is another process's: a source drops what it keeps locally for its next fetches
    (pg_logical: the spool of a huge transaction)."""
    forget = getattr(source, "forget", None)
    if callable(forget):
        forget()


def _source_notes(source: Source, adopt: Mapping[str, Any] | None = None) -> Mapping[str, Any]:
    """What a source records in the checkpoint's metadata for ``dbfanout status`` (a binlog poller:
    the TRUNCATEs it read); ``adopt``: the metadata the tick found, which it carries on."""
    notes = getattr(source, "checkpoint_notes", None)
    if not callable(notes):
        return {}
    found: Mapping[str, Any] = notes(adopt)
    return found


@contextmanager
def _stage(stage: str, poller: str) -> Iterator[None]:
    """Count a failure of this step by stage (the metric operators alert on); errors propagate.

    A refusing broker is counted by ``dbfanout.sends_refused`` instead (:mod:`poller.tick.backoff`).
    """
    try:
        yield
    except BrokerRefusingError:
        raise
    except Exception:
        metrics.failures.add(1, {"stage": stage, "poller": poller})
        raise

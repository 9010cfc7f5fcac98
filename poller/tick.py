"""One timer tick: the poller's lifecycle, in the order seed 001 §2 gives it.

acquire lease (CAS) → load checkpoint (same read) → verify fingerprint → up to
``max_batches_per_tick`` pages within the time budget: fetch → normalize → **send** → **commit**
(the commit only after every message was accepted; it also extends the lease) → release.

Commits run through :class:`~poller.committer.Committer`: with ``max_uncommitted_batches`` > 1
the next page is fetched and sent while the previous commit is in flight, and one write covers
every page accepted meanwhile; a tick never ends (nor releases) before its last commit landed.

Failure branches name their window (W1-W7, see the operations guide). Ordinary outcomes (lease
held elsewhere, lease lost mid-tick, caught up) are results; failures that need attention raise
after the lease was released.
"""

from __future__ import annotations

import datetime as dt
import os
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Literal

from poller.committer import Committer
from poller.events import page_batch
from poller.lease import LeaseKeeper
from poller.ports import Page, Sink, Source, StateStore
from shared.config import PollerConfig
from shared.errors import CommitAmbiguousError, CommitError, LostLeaseError
from shared.logs import get_logger, ids
from shared.models import Batch, Checkpoint
from shared.telemetry import metrics

__all__ = ["TickResult", "default_owner_id", "run_tick"]

log = get_logger("poller.tick")

StopReason = Literal["caught_up", "max_batches", "time_budget", "lease_held", "lease_lost"]


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
) -> TickResult:
    """Run one tick of ``poller``. Raises the typed error of a failed step (after releasing)."""
    ttl = dt.timedelta(seconds=poller.lease_ttl_seconds)
    fingerprint = source.fingerprint
    log.debug("tick started", extra=ids(poller=poller.name))
    with _stage("acquire", poller.name):
        snap = store.try_acquire(owner_id or default_owner_id(), ttl, fingerprint)
    if snap is None:
        log.debug("lease held elsewhere; skipping tick", extra=ids(poller=poller.name))
        return TickResult(poller.name, "lease_held")
    keeper = LeaseKeeper(store, snap, ttl, clock=clock)
    try:
        # A slow fetch or send must not let the lease lapse: heartbeat in the background (R11).
        # It writes only when a third of the TTL is left; commits extend the lease as they land.
        with keeper.renewing_in_background(), source.pinned():
            result = _drain(poller, source, sink, keeper, fingerprint, clock, monotonic)
        _acknowledge(source, keeper.checkpoint, poller.name)
        return result
    except LostLeaseError:
        log.warning(
            "lease lost mid-tick; the new owner re-sends the batch",
            extra=ids(poller=poller.name, window="W4", fencing_token=keeper.fencing_token),
        )
        return TickResult(poller.name, "lease_lost", fencing_token=keeper.fencing_token)
    finally:
        keeper.release()  # best effort: never raises; makes the lease immediately re-acquirable


def _acknowledge(source: Source, checkpoint: Checkpoint, poller: str) -> None:
    """Tell the source what landed (it may prune or advance); its failure never fails the tick."""
    if checkpoint.position is None:
        return
    try:
        with _stage("acknowledge", poller):
            source.acknowledge(checkpoint)
    except Exception as exc:
        log.warning("source housekeeping after the commit failed: %r", exc, extra=ids(poller=poller))


def _drain(
    poller: PollerConfig,
    source: Source,
    sink: Sink,
    keeper: LeaseKeeper,
    fingerprint: str,
    clock: Callable[[], dt.datetime],
    monotonic: Callable[[], float],
) -> TickResult:
    deadline = monotonic() + poller.time_budget_seconds
    nulls = 0
    reason: StopReason = "max_batches"
    position = keeper.checkpoint.position  # where the next page starts: after the last *accepted* one
    committer: Committer[tuple[Checkpoint, object]] = Committer(
        lambda item: _commit(keeper, *item, poller.name),
        poller.max_uncommitted_batches,
        name=f"committer-{poller.name}",
    )
    try:
        for _ in range(poller.max_batches_per_tick):
            with _stage("fetch", poller.name):
                page = source.fetch(position, poller.batch_size)
            metrics.rows_fetched.add(len(page), {"poller": poller.name})
            nulls = max(nulls, page.skipped_null_cursors)
            if not len(page):
                reason = "caught_up"
                break
            batch = page_batch(poller, fingerprint, page)
            committer.wait_for_room()  # at most max_uncommitted_batches sent ahead of the checkpoint
            _send(sink, batch)
            committer.submit(_checkpoint_after(poller, batch, page, clock), len(page))
            position = page.last
            if len(page) < poller.batch_size:
                reason = "caught_up"
                break
            if monotonic() >= deadline:
                reason = "time_budget"
                break
        landed = committer.flush()
    except Exception:
        # Land what the sink already accepted (fewer re-sends); the original error still propagates.
        with suppress(Exception):
            committer.flush()
        raise
    finally:
        committer.close()
    return TickResult(poller.name, reason, landed.rows, landed.batches, keeper.fencing_token, nulls)


def _send(sink: Sink, batch: Batch) -> None:
    with _stage("send", batch.poller):
        sink.send(batch)
    log.info(
        "batch enqueued",
        extra=ids(poller=batch.poller, batch_id=batch.batch_id, events=len(batch.events)),
    )


def _checkpoint_after(
    poller: PollerConfig, batch: Batch, page: Page, clock: Callable[[], dt.datetime]
) -> tuple[Checkpoint, object]:
    """The checkpoint past ``page``, with the last row's typed cursor (for the lag metric)."""
    last = page.last_row
    assert last is not None
    checkpoint = Checkpoint(
        position=last.position,
        last_successful_batch_id=batch.batch_id,
        updated_at=clock(),
        metadata={"row_count": len(page)},
    )
    return checkpoint, last.values.get(poller.cursor, last.position.cursor)


def _commit(keeper: LeaseKeeper, checkpoint: Checkpoint, last_cursor: object, poller: str) -> None:
    """Write ``checkpoint`` — only ever after the sink accepted every page up to it."""
    batch_id = checkpoint.last_successful_batch_id
    try:
        with _stage("commit", poller):
            keeper.commit(checkpoint)
    except CommitAmbiguousError:
        # W5: the write may have landed. Reload: if it did, go on; if not, the pages are re-sent.
        if keeper.resolve_ambiguous(checkpoint):
            log.info("ambiguous commit had landed", extra=ids(poller=poller, batch_id=batch_id))
            return
        log.warning(
            "ambiguous commit did not land; the batch will be re-sent",
            extra=ids(poller=poller, batch_id=batch_id, window="W5"),
        )
        raise
    except CommitError:
        log.warning(
            "checkpoint commit failed; the batch will be re-sent",
            extra=ids(poller=poller, batch_id=batch_id, window="W1"),
        )
        raise
    log.info(
        "checkpoint committed",
        extra=ids(poller=poller, batch_id=batch_id, fencing_token=keeper.fencing_token),
    )
    _record_success(poller, checkpoint, last_cursor)


@contextmanager
def _stage(stage: str, poller: str) -> Iterator[None]:
    """Count a failure of this step by stage (the metric operators alert on); errors propagate."""
    try:
        yield
    except Exception:
        metrics.failures.add(1, {"stage": stage, "poller": poller})
        raise


def _record_success(poller: str, checkpoint: Checkpoint, cursor: object) -> None:
    attrs = {"poller": poller}
    now = checkpoint.updated_at or _utcnow()
    metrics.last_success_timestamp.record(now.timestamp(), attrs)
    if isinstance(cursor, dt.datetime) and cursor.tzinfo is not None:
        metrics.lag_seconds.record(max(0.0, (now - cursor).total_seconds()), attrs)

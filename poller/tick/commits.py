"""The tick's commit step: the checkpoint after each accepted page, its write, and what follows it.

Only ever after the sink accepted every page up to it (STYLE R7): :meth:`Commits.commit` writes
through the :class:`~poller.lease.keeper.LeaseKeeper` (the write also extends the lease), resolves
an ambiguous write (W5) and logs a failed one (W1); :meth:`Commits.committed` is what must follow
each landed write (log, metrics), once per write, in order, on the thread that wrote it;
:meth:`Commits.acknowledge` and :meth:`Commits.observe_lag_rows` may wait for the tick's last one.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Mapping
from contextlib import suppress
from typing import Any
from zoneinfo import ZoneInfo

from poller.lease.keeper import LeaseKeeper
from poller.ports import SOURCE_NOTES, CountsPending, Page, Source
from poller.tick.committer import Committer
from poller.tick.epochs import ORDER, Order
from poller.tick.stage import stage
from shared.config import PollerConfig
from shared.errors import CommitAmbiguousError, CommitError, DbFanoutError
from shared.logs import get_logger, ids
from shared.models import Batch, Checkpoint, Position
from shared.telemetry import metrics

__all__ = ["LAG_ROWS_LIMIT", "Commits"]

log = get_logger("poller.tick")

#: ``dbfanout.lag_rows`` counts a backlog up to this many rows: one bounded count per tick that stops short.
LAG_ROWS_LIMIT = 10_000


def _utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


class Commits:
    """The commit step of one poller's ticks, with what it shares bound once."""

    def __init__(self, poller: PollerConfig, source: Source, clock: Callable[[], dt.datetime]) -> None:
        self.poller = poller
        self.name = poller.name
        self.source = source
        self.clock = clock
        self._cursor_tz = ZoneInfo(poller.cursor_timezone) if poller.cursor_timezone else None

    def after(
        self, batch: Batch, page: Page, notes: Mapping[str, Any] | None = None, order: Order | None = None
    ) -> Checkpoint:
        """The checkpoint past ``page`` (to write once the sink accepted it), with the source's notes
        and the order epoch after it."""
        end = page.end
        assert end is not None
        return Checkpoint(
            position=end,
            last_successful_batch_id=batch.batch_id,
            updated_at=self.clock(),
            metadata=_metadata(len(page), notes, order),
        )

    def moved(
        self,
        keeper: LeaseKeeper,
        position: Position,
        notes: Mapping[str, Any] | None = None,
        order: Order | None = None,
    ) -> Checkpoint:
        """The checkpoint at ``position`` with no row sent (a source state change no row carries)."""
        return Checkpoint(
            position=position,
            last_successful_batch_id=keeper.checkpoint.last_successful_batch_id,
            updated_at=self.clock(),
            metadata=_metadata(0, notes, order),
        )

    def commit(self, keeper: LeaseKeeper, checkpoint: Checkpoint) -> None:
        """Write ``checkpoint`` — only ever after the sink accepted every page up to it."""
        batch_id = checkpoint.last_successful_batch_id
        try:
            with stage("commit", self.name):
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
        landed = getattr(self.source, "landed", None)
        if callable(landed):  # a log source may free what the write covers before the tick ends
            landed(checkpoint)

    def acknowledge(self, checkpoint: Checkpoint) -> None:
        """Tell the source what landed (it may prune or advance; before the first checkpoint too:
        a pg_logical slot advances while its tables are quiet); its failure never fails the tick."""
        try:
            with stage("acknowledge", self.name):
                self.source.acknowledge(checkpoint)
        except Exception as exc:
            log.warning("source housekeeping after the commit failed: %r", exc, extra=ids(poller=self.name))

    def observe_lag_rows(self, stop_reason: str, checkpoint: Checkpoint) -> None:
        """``dbfanout.lag_rows``: 0 when the tick caught up (no query), else the rows still after
        the checkpoint, counted up to :data:`LAG_ROWS_LIMIT`; sources that cannot count are skipped."""
        if not isinstance(self.source, CountsPending):
            return
        attrs = {"poller": self.name}
        if stop_reason == "caught_up":
            metrics.lag_rows.record(0, attrs)
            return
        if stop_reason not in ("max_batches", "time_budget"):
            return
        try:
            pending = self.source.pending_rows(checkpoint.position, LAG_ROWS_LIMIT)
        except Exception as exc:  # a metric never fails a tick that landed
            log.warning("could not count the rows still to send: %r", exc, extra=ids(poller=self.name))
            return
        metrics.lag_rows.record(pending, attrs)

    def land_accepted(self, committer: Committer[Checkpoint], keeper: LeaseKeeper, failure: Exception) -> None:
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

    def mark(self, keeper: LeaseKeeper, marked: Checkpoint) -> None:
        """Write a checkpoint that only records a state (a refusing broker's, same position)."""
        try:
            with stage("commit", self.name):
                keeper.commit(marked)
        except Exception as exc:  # the state is for status only: backing off does not depend on it
            log.warning("could not record the refusal in the state blob: %r", exc, extra=ids(poller=self.name))


def _metadata(rows: int, notes: Mapping[str, Any] | None, order: Order | None) -> dict[str, Any]:
    """A checkpoint's metadata: its page's rows, the source's notes and the order epoch (when set)."""
    metadata: dict[str, Any] = {"row_count": rows}
    if notes:
        metadata[SOURCE_NOTES] = notes
    if order is not None and (note := order.note()) is not None:
        metadata[ORDER] = note
    return metadata

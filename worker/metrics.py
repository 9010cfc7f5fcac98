"""The hook that counts deliveries: handler time, events handled, splits, failures, dead letters, latency."""

from __future__ import annotations

import datetime as dt
import time

from shared.telemetry import metrics, recording
from worker.delivery import Delivery, DeliveryInfo
from worker.hooks import Hook
from worker.settlement import Settle

__all__ = ["Metrics"]

#: How the commit time of a change-log source's events is labelled (``commit_time`` attribute).
_COMMIT_KIND = {"pg_logical": "pg_commit", "mysql_binlog": "binlog_commit", "outbox": "outbox_created"}


class Metrics(Hook):
    """The worker's instruments of :mod:`shared.telemetry` (names and attributes are a contract)."""

    def rejected(self, stage: str, delivery: Delivery, info: DeliveryInfo | None) -> None:
        metrics.failures.add(1, {"stage": stage} if info is None else {"stage": stage, "poller": info.batch.poller})

    def after_handler(self, info: DeliveryInfo, seconds: float, error: Exception | None) -> None:
        metrics.handler_duration.record(seconds, info.attrs)
        if error is not None:
            metrics.deliveries_failed.add(1, info.attrs)

    def after_split(self, info: DeliveryInfo) -> None:
        metrics.messages_split.add(1, info.attrs)

    def after_delivery(self, info: DeliveryInfo, outcome: Settle, error: Exception | None) -> None:
        if outcome is Settle.COMPLETE:
            metrics.events_handled.add(len(info.batch.events), info.attrs)
            if recording():  # one observation per commit: skipped without a metrics SDK
                observe_latency(info)
        elif outcome is Settle.RAISE:
            metrics.failures.add(1, {"stage": "handler", "poller": info.batch.poller})
            if info.last:  # the broker quarantines it now
                metrics.events_dead_lettered.add(len(info.batch.events), info.attrs)


def observe_latency(info: DeliveryInfo) -> None:
    """``dbfanout.commit_to_handler``: one observation per source commit the delivery carried.

    The events of one commit (a pg_logical transaction, the rows one read fetched) share their
    commit time, so they reached the handler equally late: one observation stands for them all,
    and ``dbfanout.events_handled`` counts the events. One per event would cost the Python SDK
    about 3 µs each, a fifth of a no-op handler's whole cost per row (BENCHMARKS.md).
    """
    cfg, batch = info.poller, info.batch
    assert cfg is not None  # the handler ran, so the poller is configured
    now = time.time()
    source_kind = _COMMIT_KIND.get(cfg.kind, "source")
    cursor_is_commit_time = cfg.cursor_is_commit_time
    zone = _zone(cfg.cursor_timezone) if cursor_is_commit_time else dt.UTC  # once, not per event
    commits: dict[tuple[dt.datetime, str], None] = {}  # distinct (commit time, where it came from)
    unknown = False  # an event whose commit time the source does not know
    last: dt.datetime | None = None  # a transaction's events share one decoded commit time: skip repeats
    for event in batch.events:
        committed = event.committed_at
        if committed is not None:
            if committed is not last:
                commits[committed, source_kind] = None
                last = committed
        elif cursor_is_commit_time and isinstance(event.cursor, dt.datetime):
            cursor = event.cursor
            commits[cursor if cursor.tzinfo else cursor.replace(tzinfo=zone), "cursor"] = None
        else:
            unknown = True
    if unknown:  # the poller's read (or the broker's enqueue): one time for the whole message
        when = batch.read_at if batch.read_at is not None else info.delivery.enqueued_time
        if when is not None:
            commits[when, "read" if batch.read_at is not None else "enqueued"] = None
    record = metrics.commit_to_handler.record
    for when, kind in commits:
        record(max(0.0, now - when.timestamp()), {**info.attrs, "commit_time": kind})


def _zone(name: str | None) -> dt.tzinfo:
    """A naive temporal cursor's time zone (``cursor_timezone``), UTC when none is configured."""
    if name is None:
        return dt.UTC
    from zoneinfo import ZoneInfo

    return ZoneInfo(name)

"""The hook that leaves each failed delivery's reason where ``dbfanout dlq`` finds it (shared.failures)."""

from __future__ import annotations

import datetime as dt
from typing import Protocol

from shared.failures import FailureRecord
from shared.logs import get_logger, ids
from shared.scrub import describe_error
from worker.delivery import DeliveryInfo
from worker.hooks import Hook
from worker.settlement import Settle

__all__ = ["FailureRecorder", "FailureRecords", "entity_of"]

log = get_logger("worker")


class FailureRecorder(Protocol):
    """Where failed deliveries leave their reason (:class:`shared.failures.FailureStore`)."""

    def record(self, record: FailureRecord, body: bytes) -> None: ...
    def clear(self, entity: str, body: bytes) -> None: ...


def entity_of(queue: str, subscription: str | None) -> str:
    """The entity a message was received on, as operators name it: ``queue`` or ``topic/subscription``."""
    return f"{queue}/{subscription}" if subscription is not None else queue


class FailureRecords(Hook):
    """Writes a record for a failing delivery (before it raises: it may be the last) and deletes it
    when a redelivery succeeds; never fails the delivery further."""

    def __init__(self, recorder: FailureRecorder) -> None:
        self._recorder = recorder

    def after_delivery(self, info: DeliveryInfo, outcome: Settle, error: Exception | None) -> None:
        if outcome is Settle.RAISE and error is not None:
            self._record(info, error)
        elif outcome is Settle.COMPLETE and info.delivery.delivery_count > 1:  # an earlier one may have left one
            self._clear(info)

    def _record(self, info: DeliveryInfo, error: Exception) -> None:
        batch, delivery = info.batch, info.delivery
        record = FailureRecord(
            entity=entity_of(info.queue or "", info.subscription),
            poller=batch.poller,
            message_id=delivery.message_id,
            delivery_count=delivery.delivery_count,
            failed_at=dt.datetime.now(dt.UTC).isoformat(),
            error_type=type(error).__name__,
            error=describe_error(error),
            event_ids=tuple(e.event_id for e in batch.events),
            subscription=info.subscription,
            dead_lettered=info.last,
        )
        try:
            self._recorder.record(record, delivery.body)
        except Exception as exc:  # the reason is also in the log line; the delivery fails either way
            log.warning(
                "could not write the failure record; `dbfanout dlq peek` will not show this reason",
                extra=ids(poller=batch.poller, message_id=delivery.message_id, error=repr(exc)),
            )

    def _clear(self, info: DeliveryInfo) -> None:
        try:
            self._recorder.clear(entity_of(info.queue or "", info.subscription), info.delivery.body)
        except Exception as exc:  # a stale record is harmless: the lifecycle rule expires it
            log.debug(
                "could not delete a failure record", extra=ids(message_id=info.delivery.message_id, error=repr(exc))
            )

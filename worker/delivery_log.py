"""The hook that logs what happens to a delivery: failures, splits, and the dead-lettering itself."""

from __future__ import annotations

from shared.logs import get_logger
from worker.delivery import DeliveryInfo
from worker.hooks import Hook
from worker.settlement import Settle

__all__ = ["DeliveryLog"]

log = get_logger("worker")


class DeliveryLog(Hook):
    """WARNING lines with the delivery's ids (and the handler's traceback) for every failure."""

    def before_split(self, info: DeliveryInfo, error: Exception | None) -> None:
        # Logged before the singles go: if the split fails, the cause is on record.
        if error is None:
            log.warning(
                "multi-event message redelivered close to its MaxDeliveryCount; splitting it before its handler runs",
                extra=info.keys(max_delivery_count=info.deliveries),
            )
            return
        log.warning(
            "handler failed on a multi-event message; splitting it into single events",
            extra={**info.keys(), "error": repr(error)},
            exc_info=error,
        )

    def after_delivery(self, info: DeliveryInfo, outcome: Settle, error: Exception | None) -> None:
        if outcome is not Settle.RAISE:
            return
        if not info.last:
            log.warning(
                "handler failed; the message will be retried, then dead-lettered",
                extra={**info.keys(), "error": repr(error)},
                exc_info=error,
            )
            return
        # The broker moves the message to its dead-letter (poison) queue when this delivery fails:
        # the one line that says so, with the events an operator will look for there.
        log.warning(
            "handler failed on the last delivery the queue allows; the message is dead-lettered",
            extra={
                **info.keys(max_delivery_count=info.deliveries),
                "event_ids": [e.event_id for e in info.batch.events],
                "error": repr(error),
            },
            exc_info=error,
        )

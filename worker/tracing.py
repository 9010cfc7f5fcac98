"""The hook that traces a delivery: one ``dbfanout.deliver`` span, continuing the sender's trace."""

from __future__ import annotations

from contextlib import AbstractContextManager

from shared.tracing import delivery_span, messaging_system
from worker.delivery import DeliveryInfo
from worker.hooks import Hook

__all__ = ["Tracing"]


class Tracing(Hook):
    """Wraps each delivery in a span; a failing delivery records its (scrubbed) error on it."""

    def delivery(self, info: DeliveryInfo) -> AbstractContextManager[object]:
        batch, delivery = info.batch, info.delivery
        attributes = {
            "messaging.system": messaging_system(info.poller.transport if info.poller is not None else "servicebus"),
            "messaging.operation": "process",
            "messaging.destination.name": info.queue,
            "messaging.message.id": delivery.message_id,
            "dbfanout.poller": batch.poller,
            "dbfanout.subscription": info.subscription,
            "dbfanout.batch_id": batch.batch_id,
            "dbfanout.delivery_count": delivery.delivery_count,
            "dbfanout.events": len(batch.events),
        }
        return delivery_span(delivery.application_properties, batch.traceparent, attributes)

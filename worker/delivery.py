"""A received message as the worker sees it, and one decoded delivery as its hooks see it."""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from shared.config import PollerConfig
from shared.logs import ids
from shared.models import Batch

__all__ = ["Delivery", "DeliveryInfo", "delivery_info"]


@dataclass(frozen=True, slots=True)
class Delivery:
    """What the worker needs of a received message (filled from a Functions or SDK message)."""

    body: bytes
    message_id: str
    delivery_count: int  # Functions semantics: 1 on the first delivery
    enqueued_time: dt.datetime | None = None
    application_properties: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class DeliveryInfo:
    """One decoded delivery, its poller looked up once (None: a poller this app does not configure)."""

    batch: Batch
    delivery: Delivery
    subscription: str | None
    poller: PollerConfig | None
    #: Metric attributes: the poller, and where the worker received the message.
    attrs: dict[str, str] = field(default_factory=dict)

    @property
    def deliveries(self) -> int:
        """The MaxDeliveryCount of the entity it was received on (each subscription has its own)."""
        assert self.poller is not None  # the handler loaded, so the poller is configured
        return self.poller.deliveries_for(self.subscription)

    @property
    def last(self) -> bool:
        """Whether this is the last delivery the broker allows: failing it quarantines the message."""
        return self.delivery.delivery_count >= self.deliveries

    @property
    def queue(self) -> str | None:
        """The queue (or topic) the poller sends to."""
        return self.poller.queue if self.poller is not None else None

    def keys(self, **more: Any) -> dict[str, Any]:
        """The log record's ids for this delivery."""
        return ids(
            poller=self.batch.poller,
            subscription=self.subscription,
            batch_id=self.batch.batch_id,
            message_id=self.delivery.message_id,
            delivery_count=self.delivery.delivery_count,
            events=len(self.batch.events),
            **more,
        )


def delivery_info(
    batch: Batch, delivery: Delivery, subscription: str | None, poller: PollerConfig | None
) -> DeliveryInfo:
    """The :class:`DeliveryInfo` of a decoded delivery."""
    attrs = {"poller": batch.poller}
    if poller is not None:
        attrs["queue"] = poller.queue
    if subscription is not None:
        attrs["subscription"] = subscription
    return DeliveryInfo(batch, delivery, subscription, poller, attrs)

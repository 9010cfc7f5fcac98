"""Split-on-failure: a failing N-event message becomes N single-event messages.

Each single gets a message id derived from its event id, so re-splitting after a crash (the
parent was not completed) produces identical messages that duplicate detection drops.

In a topic subscription the singles go back to the topic, addressed to that subscription alone
(``shared.topology.PROP_TARGET``), with ids that include the subscription: the other
subscriptions never see them, and two subscriptions splitting the same parent do not collide in
the topic's duplicate detection.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from shared.config import Config
from shared.ids import split_message_id, subscription_split_message_id
from shared.messages import OutgoingMessage, pack_batch, session_key
from shared.models import Batch
from shared.topology import PROP_TARGET
from shared.tracing import PROP_DIAGNOSTIC_ID, PROP_TRACEPARENT, current_traceparent

__all__ = ["PROP_SPLIT_FROM", "Splitter"]

PROP_SPLIT_FROM = "dbfanout-split-from"


class Splitter:
    """Sends the singles through ``send_all(queue, messages)`` (returns once all were accepted)."""

    def __init__(self, config: Config, send_all: Callable[[str, list[OutgoingMessage]], None]) -> None:
        self._config = config
        self._send_all = send_all

    def singles(self, batch: Batch, parent_message_id: str, subscription: str | None = None) -> list[OutgoingMessage]:
        """The single-event messages of ``batch``; ``subscription``: addressed to that one only."""
        poller = self._config.pollers[batch.poller]
        limit = poller.max_message_bytes
        extra = {PROP_SPLIT_FROM: parent_message_id}
        if subscription is not None:
            extra[PROP_TARGET] = subscription
        # The singles continue the trace of the delivery that split them (else the parent's sender's).
        traceparent = current_traceparent() or batch.traceparent
        if traceparent is not None:
            batch = replace(batch, traceparent=traceparent)
            extra |= {PROP_TRACEPARENT: traceparent, PROP_DIAGNOSTIC_ID: traceparent}
        singles: list[OutgoingMessage] = []
        for event in batch.events:
            (message,) = pack_batch(replace(batch, events=(event,)), limit, oversize=lambda e, _n: e)
            message_id = (
                split_message_id(event.event_id)
                if subscription is None
                else subscription_split_message_id(event.event_id, subscription)
            )
            singles.append(
                replace(
                    message,
                    message_id=message_id,
                    # a session-enabled queue refuses a message without one; keep the key's order
                    session_id=session_key(poller.pk, event) if poller.sessions else None,
                    application_properties={**message.application_properties, **extra},
                )
            )
        return singles

    def split(self, batch: Batch, *, parent_message_id: str, queue: str, subscription: str | None = None) -> None:
        """Send the singles to ``queue`` (a topic poller: its topic, for ``subscription`` only)."""
        self._send_all(queue, self.singles(batch, parent_message_id, subscription))

"""What every queue sink does: pack a batch under the transport's size limit, send it all, count it.

The tick commits its checkpoint only after :meth:`QueueSink.send` returned, which it does only
once the queue accepted every message of the batch.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Protocol

from shared.config import PollerConfig
from shared.messages import OutgoingMessage, pack_batch
from shared.models import Batch, RowChange
from shared.telemetry import metrics
from shared.tracing import PROP_DIAGNOSTIC_ID, PROP_TRACEPARENT, current_traceparent, send_span

__all__ = ["ClaimCheckHook", "MessageSender", "QueueSink"]

ClaimCheckHook = Callable[[RowChange, int], RowChange]


class MessageSender(Protocol):
    def send_all(self, messages: Sequence[OutgoingMessage]) -> None: ...
    def close(self) -> None: ...


class QueueSink:
    """Implements the poller's ``Sink`` port on one reusable sender."""

    def __init__(
        self,
        poller: PollerConfig,
        sender: MessageSender,
        *,
        limit: int,
        claim_check: ClaimCheckHook | None = None,
    ) -> None:
        self._poller = poller
        self._sender = sender
        self._limit = limit
        self._claim_check = claim_check if poller.oversize_policy == "claim-check" else None

    def messages_for(self, batch: Batch) -> list[OutgoingMessage]:
        return pack_batch(batch, self._limit, oversize=self._claim_check)

    def send(self, batch: Batch) -> None:
        span = send_span(
            batch.poller, self._poller.queue, batch.batch_id, len(batch.events), transport=self._poller.transport
        )
        with span:
            traceparent = current_traceparent()  # None without a tracing SDK: nothing is stamped
            # The envelope carries the trace context (storage queues have no properties) and the time
            # the poller sent the page, read just before: commit -> handler latency falls back to it.
            batch = replace(batch, traceparent=traceparent, read_at=batch.read_at or dt.datetime.now(dt.UTC))
            messages = self.messages_for(batch)
            if traceparent is not None:
                messages = [_stamped(m, traceparent) for m in messages]
            self._sender.send_all(messages)
        metrics.messages_enqueued.add(len(messages), {"poller": batch.poller})

    def close(self) -> None:
        self._sender.close()


def _stamped(message: OutgoingMessage, traceparent: str) -> OutgoingMessage:
    """The trace context in the properties the Functions host and the Azure SDKs read (Service Bus;
    a storage queue's sender sends the body only)."""
    props = {**message.application_properties, PROP_TRACEPARENT: traceparent, PROP_DIAGNOSTIC_ID: traceparent}
    return replace(message, application_properties=props)

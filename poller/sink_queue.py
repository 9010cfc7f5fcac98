"""What every queue sink does: pack a batch under the transport's size limit, send it all, count it.

The tick commits its checkpoint only after :meth:`QueueSink.send` returned, which it does only
once the queue accepted every message of the batch. ``send`` is :meth:`QueueSink.prepare` (packing,
CPU only) then :meth:`QueueSink.deliver` (the round trip): the tick may pack the next page while the
previous page's delivery is in flight (a :class:`~poller.ports.SplitSink`).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from opentelemetry.trace import Span

from shared.config import PollerConfig
from shared.messages import OutgoingMessage, pack_batch
from shared.models import Batch, RowChange
from shared.telemetry import metrics
from shared.tracing import (
    PROP_DIAGNOSTIC_ID,
    PROP_TRACEPARENT,
    record_failure,
    span_in_thread,
    start_send_span,
    traceparent_of,
)

__all__ = ["ClaimCheckHook", "MessageSender", "PreparedMessages", "QueueSink"]

ClaimCheckHook = Callable[[RowChange, int], RowChange]


class MessageSender(Protocol):
    def send_all(self, messages: Sequence[OutgoingMessage]) -> None: ...
    def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class PreparedMessages:
    """A batch's messages, built and not sent yet, and its send span (open until sent or discarded)."""

    batch: Batch
    messages: list[OutgoingMessage]
    span: Span

    def discard(self) -> None:
        self.span.end()


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

    def prepare(self, batch: Batch) -> PreparedMessages:
        """The batch's messages, stamped with the trace context of its send span (started here,
        ended by :meth:`deliver` or :meth:`PreparedMessages.discard`)."""
        span = start_send_span(
            batch.poller, self._poller.queue, batch.batch_id, len(batch.events), transport=self._poller.transport
        )
        try:
            traceparent = traceparent_of(span)  # None without a tracing SDK: nothing is stamped
            # The envelope carries the trace context (storage queues have no properties) and the time
            # the poller sent the page, read just before: commit -> handler latency falls back to it.
            batch = replace(batch, traceparent=traceparent, read_at=batch.read_at or dt.datetime.now(dt.UTC))
            messages = self.messages_for(batch)
            if traceparent is not None:
                messages = [_stamped(m, traceparent) for m in messages]
        except Exception as exc:
            record_failure(span, exc)
            span.end()
            raise
        return PreparedMessages(batch, messages, span)

    def deliver(self, prepared: PreparedMessages) -> None:
        """Send what :meth:`prepare` built; returns only when the queue accepted every message."""
        with span_in_thread(prepared.span):
            self._sender.send_all(prepared.messages)
        metrics.messages_enqueued.add(len(prepared.messages), {"poller": prepared.batch.poller})

    def send(self, batch: Batch) -> None:
        self.deliver(self.prepare(batch))

    def close(self) -> None:
        self._sender.close()


def _stamped(message: OutgoingMessage, traceparent: str) -> OutgoingMessage:
    """The trace context in the properties the Functions host and the Azure SDKs read (Service Bus;
    a storage queue's sender sends the body only)."""
    props = {**message.application_properties, PROP_TRACEPARENT: traceparent, PROP_DIAGNOSTIC_ID: traceparent}
    return replace(message, application_properties=props)

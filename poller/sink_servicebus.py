"""The Service Bus sink: a batch becomes one or more messages with deterministic ids.

The tick commits its checkpoint only after :meth:`ServiceBusSink.send` returned, which it does
only once the broker accepted every message. A re-send after a failed commit (W1) produces the
same message ids, and the queue's duplicate detection drops the copies.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from shared.config import PollerConfig
from shared.messages import OutgoingMessage, pack_batch
from shared.models import Batch, RowChange
from shared.servicebus import QueueSender
from shared.telemetry import metrics

__all__ = ["ServiceBusSink"]


class ServiceBusSink:
    """Implements the poller's ``Sink`` port on one reusable queue sender."""

    def __init__(
        self,
        poller: PollerConfig,
        sender: QueueSender,
        *,
        claim_check: Callable[[RowChange, int], RowChange] | None = None,
    ) -> None:
        self._poller = poller
        self._sender = sender
        self._claim_check = claim_check if poller.oversize_policy == "claim-check" else None

    def messages_for(self, batch: Batch) -> list[OutgoingMessage]:
        limit = self._poller.max_message_bytes
        if not self._poller.sessions:
            return pack_batch(batch, limit, oversize=self._claim_check)
        # Per-key ordering: each message carries one event and the session of its primary key.
        by_id = {e.event_id: e for e in batch.events}
        return [
            replace(m, session_id=session_key(self._poller, by_id[m.event_ids[0]]))
            for m in pack_batch(batch, limit, oversize=self._claim_check, max_events=1)
        ]

    def send(self, batch: Batch) -> None:
        messages = self.messages_for(batch)
        self._sender.send_all(messages)
        metrics.messages_enqueued.add(len(messages), {"poller": batch.poller})

    def close(self) -> None:
        self._sender.close()


def session_key(poller: PollerConfig, event: RowChange) -> str:
    """Session id for per-key ordering: the primary key values (Service Bus allows 128 chars)."""
    return "|".join(f"{k}={event.pk.get(k)}" for k in poller.pk)[:128]

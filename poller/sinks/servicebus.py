"""The Service Bus sink: a batch becomes one or more messages with deterministic ids.

A re-send after a failed commit (W1) produces the same message ids, and the queue's duplicate
detection drops the copies.
"""

from __future__ import annotations

from dataclasses import replace

from poller.sinks.queue import ClaimCheckHook, QueueSink
from shared.config import PollerConfig
from shared.messages import OutgoingMessage, pack_batch, session_key
from shared.models import Batch
from shared.servicebus import QueueSender

__all__ = ["ServiceBusSink"]


class ServiceBusSink(QueueSink):
    """Queue sink on a Service Bus sender; with ``sessions``, one message per key, in its session."""

    def __init__(self, poller: PollerConfig, sender: QueueSender, *, claim_check: ClaimCheckHook | None = None) -> None:
        super().__init__(poller, sender, limit=poller.max_message_bytes, claim_check=claim_check)

    def messages_for(self, batch: Batch) -> list[OutgoingMessage]:
        if not self._poller.sessions:
            return super().messages_for(batch)
        # Per-key ordering: each message carries one event and the session of its primary key.
        by_id = {e.event_id: e for e in batch.events}
        return [
            replace(m, session_id=session_key(self._poller.pk, by_id[m.event_ids[0]]))
            for m in pack_batch(batch, self._limit, oversize=self._claim_check, max_events=1)
        ]

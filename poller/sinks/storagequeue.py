"""The Storage Queue sink: the same envelope as Service Bus, in messages of at most 48 KiB.

Storage Queues do not drop duplicates, so a batch re-sent after a failed commit (W1) is
delivered twice; the worker-side processed-events helper is mandatory with this transport.
"""

from __future__ import annotations

from poller.sinks.queue import ClaimCheckHook, QueueSink
from shared.config import PollerConfig
from shared.storagequeue import MAX_BODY_BYTES, StorageQueueSender

__all__ = ["StorageQueueSink"]


class StorageQueueSink(QueueSink):
    """Queue sink on a storage queue (base64 text, 64 KiB per message)."""

    def __init__(
        self, poller: PollerConfig, sender: StorageQueueSender, *, claim_check: ClaimCheckHook | None = None
    ) -> None:
        super().__init__(poller, sender, limit=min(poller.max_message_bytes, MAX_BODY_BYTES), claim_check=claim_check)

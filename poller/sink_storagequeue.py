"""The Storage Queue sink: the same envelope as Service Bus, in messages of at most 48 KiB.

Storage Queues do not drop duplicates, so a batch re-sent after a failed commit (W1) is
delivered twice; the worker-side processed-events helper is mandatory with this transport.
"""

from __future__ import annotations

from collections.abc import Callable

from shared.config import PollerConfig
from shared.messages import OutgoingMessage, pack_batch
from shared.models import Batch, RowChange
from shared.storagequeue import MAX_BODY_BYTES, StorageQueueSender
from shared.telemetry import metrics

__all__ = ["StorageQueueSink"]


class StorageQueueSink:
    """Implements the poller's ``Sink`` port on a storage queue."""

    def __init__(
        self,
        poller: PollerConfig,
        sender: StorageQueueSender,
        *,
        claim_check: Callable[[RowChange, int], RowChange] | None = None,
    ) -> None:
        self._poller = poller
        self._sender = sender
        self._claim_check = claim_check if poller.oversize_policy == "claim-check" else None
        self._limit = min(poller.max_message_bytes, MAX_BODY_BYTES)

    def messages_for(self, batch: Batch) -> list[OutgoingMessage]:
        return pack_batch(batch, self._limit, oversize=self._claim_check)

    def send(self, batch: Batch) -> None:
        messages = self.messages_for(batch)
        self._sender.send_all(messages)
        metrics.messages_enqueued.add(len(messages), {"poller": batch.poller})

    def close(self) -> None:
        self._sender.close()

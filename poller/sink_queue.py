"""What every queue sink does: pack a batch under the transport's size limit, send it all, count it.

The tick commits its checkpoint only after :meth:`QueueSink.send` returned, which it does only
once the queue accepted every message of the batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from shared.config import PollerConfig
from shared.messages import OutgoingMessage, pack_batch
from shared.models import Batch, RowChange
from shared.telemetry import metrics

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
        messages = self.messages_for(batch)
        self._sender.send_all(messages)
        metrics.messages_enqueued.add(len(messages), {"poller": batch.poller})

    def close(self) -> None:
        self._sender.close()

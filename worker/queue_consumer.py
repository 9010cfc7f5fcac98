"""Running the worker from a storage queue, with the Functions queue trigger's semantics.

Success deletes the message. A failure makes it visible again after ``visibility_timeout``;
once it has failed ``max_dequeue_count`` times it is moved to ``<queue>-poison`` — see
:func:`worker.settlement.settle_queue`, which the local host settles through as well.
"""

from __future__ import annotations

from collections.abc import Callable

from azure.storage.queue import QueueClient, QueueMessage

from shared.errors import EnvelopeError
from shared.storagequeue import decode_queue_text
from worker.runtime import Delivery
from worker.settlement import settle_queue

__all__ = ["delivery_from_queue", "settle_queue_message"]

Process = Callable[[Delivery], object]


def delivery_from_queue(msg: QueueMessage) -> Delivery:
    """Queue message → worker delivery. ``dequeue_count`` is already 1 on the first delivery."""
    try:
        body = decode_queue_text(msg.content)
    except (ValueError, TypeError) as exc:
        raise EnvelopeError(f"queue message {msg.id} is not base64 text") from exc
    return Delivery(
        body=body, message_id=str(msg.id), delivery_count=int(msg.dequeue_count or 1), enqueued_time=msg.inserted_on
    )


def settle_queue_message(
    queue: QueueClient,
    poison: QueueClient,
    msg: QueueMessage,
    process: Process,
    *,
    max_dequeue_count: int = 5,
    visibility_timeout: int = 0,
) -> bool:
    """Process one received message and settle it like the Functions host. True when it was deleted."""
    error: Exception | None = None
    try:
        process(delivery_from_queue(msg))
    except Exception as exc:  # any failure: retry, then the poison queue
        error = exc
    return settle_queue(
        queue, poison, msg, error, max_dequeue_count=max_dequeue_count, visibility_timeout=visibility_timeout
    )

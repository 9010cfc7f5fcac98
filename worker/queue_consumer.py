"""Running the worker from a storage queue, with the Functions queue trigger's semantics.

Success deletes the message. A failure makes it visible again after ``visibility_timeout``;
once it has failed ``max_dequeue_count`` times it is moved to ``<queue>-poison`` — the copy is
written first and the original deleted after, so a crash in between duplicates, never loses.
"""

from __future__ import annotations

from collections.abc import Callable

from azure.core.exceptions import AzureError
from azure.storage.queue import QueueClient, QueueMessage

from shared.errors import EnvelopeError
from shared.logs import get_logger, ids
from shared.storagequeue import decode_queue_text
from worker.runtime import Delivery

__all__ = ["delivery_from_queue", "settle_queue_message"]

log = get_logger("worker.queue")

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
    try:
        process(delivery_from_queue(msg))
    except Exception as exc:  # any failure: retry, then the poison queue
        attempts = int(msg.dequeue_count or 1)
        if attempts >= max_dequeue_count:
            # 1. the poison copy is durable, and never expires (the default TTL is 7 days): a
            #    quarantine that silently empties itself would lose data
            poison.send_message(msg.content, time_to_live=-1)
            _quietly(lambda: queue.delete_message(msg), "delete", msg)  # 2. only then drop the original
            log.warning(
                "message moved to the poison queue",
                extra=ids(message_id=msg.id, queue=queue.queue_name, dequeue_count=attempts, error=repr(exc)),
            )
        else:
            _quietly(lambda: queue.update_message(msg, visibility_timeout=visibility_timeout), "release", msg)
        return False
    _quietly(lambda: queue.delete_message(msg), "delete", msg)
    return True


def _quietly(action: Callable[[], object], what: str, msg: QueueMessage) -> None:
    try:
        action()
    except AzureError as exc:
        # The pop receipt went stale (visibility timeout passed): the message comes back; handlers dedupe.
        log.warning(f"{what} failed; the message will be seen again", extra=ids(message_id=msg.id, error=repr(exc)))

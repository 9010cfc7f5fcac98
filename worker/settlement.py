"""Settling a message: what the handler's outcome means, and telling the broker.

:func:`decide` is the pure decision (STYLE R10). :func:`settle_bus` and :func:`settle_queue` are
the one place that carries a handler's outcome to the broker, with the Functions host's rules
(``autoCompleteMessages`` for Service Bus, the queue trigger for storage queues). The worker's
consumers (``worker.consumer``, ``worker.queue_consumer``) and the local host
(``dbfanout.host``) settle through them, so they cannot drift apart.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence

from azure.core.exceptions import AzureError
from azure.servicebus import ServiceBusReceivedMessage, ServiceBusReceiver
from azure.servicebus.exceptions import ServiceBusError
from azure.storage.queue import QueueClient, QueueMessage

from shared.logs import get_logger, ids

__all__ = ["CRASH_MARGIN", "Settle", "decide", "settle_bus", "settle_queue", "split_first"]

log = get_logger("worker.settlement")


class Settle(enum.Enum):
    COMPLETE = "complete"  # success: the host completes the message
    SPLIT = "split"  # re-enqueue each event alone, then let the parent complete
    RAISE = "raise"  # fail the invocation: the host abandons; DLQ after MaxDeliveryCount


#: A failing batch with fewer deliveries than this left is split at once: a crash (SIGKILL, a lost
#: host) uses up a delivery without calling the handler, and a few of them between two failures
#: would otherwise dead-letter the batch whole, its healthy rows with its poison one.
CRASH_MARGIN = 3


def decide(ok: bool, n_events: int, delivery_count: int, split_after: int, max_deliveries: int = 10) -> Settle:
    """What to do with a message once its handler ran.

    ``delivery_count`` is the Functions host's (1 on the first delivery); ``max_deliveries`` the
    queue's MaxDeliveryCount. A failing multi-event message is retried whole first (the failure may
    be transient) and split from its ``split_after``-th delivery on — or on this failure already
    when fewer than :data:`CRASH_MARGIN` deliveries would remain after it.
    """
    if ok:
        return Settle.COMPLETE
    close_to_quarantine = max_deliveries - delivery_count < CRASH_MARGIN
    if n_events > 1 and (delivery_count >= split_after or close_to_quarantine):
        return Settle.SPLIT
    return Settle.RAISE


def split_first(n_events: int, delivery_count: int, max_deliveries: int = 10) -> bool:
    """Whether to split a multi-event message before its handler runs.

    A redelivery (``delivery_count`` > 1) that reaches the worker this close to quarantine (fewer
    than :data:`CRASH_MARGIN` deliveries left after it) lost its earlier deliveries to failures or
    crashes. If the handler crashes the host on it again (a row that kills the process, not one that
    raises), :func:`decide` never gets to run and the batch would be dead-lettered whole. Split
    first: each event then has its own deliveries, and only the row that kills is quarantined.
    """
    return n_events > 1 and delivery_count > 1 and max_deliveries - delivery_count < CRASH_MARGIN


def settle_bus(
    receiver: ServiceBusReceiver, messages: Sequence[ServiceBusReceivedMessage], error: BaseException | None
) -> int:
    """Complete every message on success; abandon each on failure (the delivery counts; Service Bus
    dead-letters at the queue's MaxDeliveryCount). Returns how many were settled as asked."""
    settled = 0
    for msg in messages:
        keys = ids(message_id=str(msg.message_id), delivery_count=(msg.delivery_count or 0) + 1)
        if error is not None:
            log.info("message failed; abandoning", extra={**keys, "error": type(error).__name__})
        action = receiver.complete_message if error is None else receiver.abandon_message
        try:
            action(msg)
        except (ServiceBusError, OSError, ValueError) as exc:
            # The lock is gone (expired, link dropped): the broker redelivers; handlers are idempotent.
            # ValueError: the SDK's word for a receiver it shut down after a lost connection (and for a
            # message already settled); the pump reopens its receiver, so neither may end the caller.
            log.warning("settlement failed; the message will be redelivered", extra={**keys, "error": repr(exc)})
            continue
        settled += 1
    return settled


def settle_queue(
    queue: QueueClient,
    poison: QueueClient,
    msg: QueueMessage,
    error: BaseException | None,
    *,
    max_dequeue_count: int = 5,
    visibility_timeout: int = 0,
) -> bool:
    """Delete the message on success. On failure make it visible again after ``visibility_timeout``,
    or, at its ``max_dequeue_count``-th failure, move it to ``<queue>-poison`` — the copy is written
    first and the original deleted after, so a crash in between duplicates, never loses. True when
    it was deleted after a success."""
    if error is None:
        _quietly(lambda: queue.delete_message(msg), "delete", msg)
        return True
    attempts = int(msg.dequeue_count or 1)
    keys = ids(message_id=msg.id, queue=queue.queue_name, dequeue_count=attempts, error=type(error).__name__)
    if attempts < max_dequeue_count:
        log.info("message failed; it becomes visible again", extra=keys)
        _quietly(lambda: queue.update_message(msg, visibility_timeout=visibility_timeout), "release", msg)
        return False
    # 1. the poison copy is durable, and never expires (the default TTL is 7 days): a quarantine that
    #    silently empties itself would lose data
    poison.send_message(msg.content, time_to_live=-1)
    _quietly(lambda: queue.delete_message(msg), "delete", msg)  # 2. only then drop the original
    log.warning("message moved to the poison queue", extra=keys, exc_info=error)
    return False


def _quietly(action: Callable[[], object], what: str, msg: QueueMessage) -> None:
    try:
        action()
    except AzureError as exc:
        # The pop receipt went stale (visibility timeout passed): the message comes back; handlers dedupe.
        log.warning(f"{what} failed; the message will be seen again", extra=ids(message_id=msg.id, error=repr(exc)))

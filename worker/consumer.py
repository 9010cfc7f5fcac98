"""Running the worker from a plain Service Bus receiver, with the Functions host's semantics.

For anyone consuming a dbfanout queue outside Azure Functions (and for ``dbfanout run``):
success completes the message, an exception abandons it (delivery count + 1) so Service Bus
dead-letters it after the queue's MaxDeliveryCount — exactly what ``autoCompleteMessages``
does on Azure. Locks are renewed while a handler runs.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from azure.servicebus import AutoLockRenewer, ServiceBusReceivedMessage, ServiceBusReceiver
from azure.servicebus.exceptions import ServiceBusError

from shared.logs import get_logger, ids
from worker.runtime import Delivery

__all__ = ["delivery_from_sdk", "drain_receiver", "settle_received"]

log = get_logger("worker.consumer")

Process = Callable[[Delivery], object]


def delivery_from_sdk(msg: ServiceBusReceivedMessage) -> Delivery:
    """SDK message → worker delivery. The SDK counts prior deliveries (0 first); Functions count from 1."""
    props = {
        (k.decode() if isinstance(k, bytes) else str(k)): (v.decode() if isinstance(v, bytes) else v)
        for k, v in (msg.application_properties or {}).items()
    }
    return Delivery(
        body=b"".join(msg.body) if not isinstance(msg.body, bytes | bytearray) else bytes(msg.body),
        message_id=str(msg.message_id or ""),
        delivery_count=(msg.delivery_count or 0) + 1,
        enqueued_time=msg.enqueued_time_utc,
        application_properties=props,
    )


def settle_received(
    receiver: ServiceBusReceiver,
    msg: ServiceBusReceivedMessage,
    process: Process,
    renewer: AutoLockRenewer | None = None,
    max_lock_renewal_seconds: float = 300.0,
) -> bool:
    """Process one message and settle it like the Functions host. True when it completed."""
    if renewer is not None:
        renewer.register(receiver, msg, max_lock_renewal_duration=max_lock_renewal_seconds)
    try:
        process(delivery_from_sdk(msg))
    except Exception as exc:  # any failure: abandon, let the broker count and dead-letter
        log.info(
            "message failed; abandoning",
            extra=ids(message_id=msg.message_id, delivery_count=msg.delivery_count, error=type(exc).__name__),
        )
        _quietly(lambda: receiver.abandon_message(msg), "abandon", msg)
        return False
    _quietly(lambda: receiver.complete_message(msg), "complete", msg)
    return True


def _quietly(action: Callable[[], None], what: str, msg: ServiceBusReceivedMessage) -> None:
    try:
        action()
    except ServiceBusError as exc:
        # The lock was lost (expired, connection dropped): the broker redelivers; handlers are idempotent.
        log.warning(
            f"{what} failed; the message will be redelivered", extra=ids(message_id=msg.message_id, error=repr(exc))
        )


def drain_receiver(
    receiver: ServiceBusReceiver,
    process: Process,
    *,
    stop: threading.Event,
    max_wait_time: float = 1.0,
    batch: int = 16,
    renewer: AutoLockRenewer | None = None,
) -> int:
    """Receive and settle until ``stop`` is set. Returns how many messages completed."""
    completed = 0
    while not stop.is_set():
        for msg in receiver.receive_messages(max_message_count=batch, max_wait_time=max_wait_time):
            completed += settle_received(receiver, msg, process, renewer)
    return completed

"""Running the worker from a plain Service Bus receiver, with the Functions host's semantics.

For anyone consuming a dbfanout queue outside Azure Functions (tests, benchmarks, custom hosts):
success completes the message, an exception abandons it (delivery count + 1) so Service Bus
dead-letters it after the queue's MaxDeliveryCount — what ``autoCompleteMessages`` does on
Azure, through the same :func:`worker.settlement.settle_bus` as ``dbfanout run``. On a topic
subscription's receiver, process with that subscription:
``functools.partial(worker.process, subscription="search")``.
"""

from __future__ import annotations

from collections.abc import Callable

from azure.servicebus import AutoLockRenewer, ServiceBusReceivedMessage, ServiceBusReceiver

from worker.runtime import Delivery
from worker.settlement import settle_bus

__all__ = ["delivery_from_sdk", "settle_received"]

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
    error: Exception | None = None
    try:
        process(delivery_from_sdk(msg))
    except Exception as exc:  # any failure: abandon, let the broker count and dead-letter
        error = exc
    return settle_bus(receiver, [msg], error) == 1 and error is None

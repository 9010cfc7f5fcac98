"""A batch receive that waits like the Functions Service Bus extension's: for the first message up to
the caller's wait, then at most :data:`BATCH_FILL_SECONDS` for more.

The extension's batch loop (``cardinality = "many"``) calls ``ServiceBusReceiver.ReceiveMessagesAsync
(maxMessageBatchSize)``, and the .NET SDK's AMQP receiver collects further messages for 20 ms after
the first (``BeginReceiveRemoteMessages(max, TimeSpan.FromMilliseconds(20), ...)``). The Python SDK
keeps pulling for 0.2 s after the first of several requested messages instead, which held every
batch call back ten times that long. So the first message is asked for alone (returned as soon as
it arrives) and the rest with a receive whose whole budget is the fill window.

That budget only holds on a receiver opened with :func:`batch_receiver_options`: the SDK checks
its deadline between socket reads, and a read with nothing to read blocks for the connection's
``socket_timeout`` (0.2 s by default), so every receive that ends empty lasted 0.2 s whatever its
``max_wait_time``.
"""

from __future__ import annotations

from azure.servicebus import ServiceBusReceivedMessage, ServiceBusReceiver

__all__ = ["BATCH_FILL_SECONDS", "batch_receiver_options", "receive_batch"]

BATCH_FILL_SECONDS = 0.02


def batch_receiver_options(many: bool) -> dict[str, float]:
    """Receiver keywords for a trigger: a short socket read for a batch receiver (its fill window),
    the SDK's default for a single-message one (which never waits on an empty read for a message)."""
    return {"socket_timeout": BATCH_FILL_SECONDS} if many else {}


def receive_batch(receiver: ServiceBusReceiver, count: int, wait: float) -> list[ServiceBusReceivedMessage]:
    """Up to ``count`` messages: none after ``wait`` s without one, else what arrives within the fill window."""
    first = receiver.receive_messages(max_message_count=1, max_wait_time=wait)
    if not first or count <= 1:
        return first
    return first + receiver.receive_messages(max_message_count=count - 1, max_wait_time=BATCH_FILL_SECONDS)

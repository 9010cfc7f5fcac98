"""Receiving like the Functions Service Bus extension: a batch is handed over at most
:data:`BATCH_FILL_SECONDS` after its first message, and no receive or settlement stalls on a socket
read for longer than :data:`SOCKET_TIMEOUT_SECONDS`.

The extension's batch loop (``cardinality = "many"``) calls ``ServiceBusReceiver.ReceiveMessagesAsync
(maxMessageBatchSize)``, and the .NET SDK's AMQP receiver collects further messages for 20 ms after
the first (``BeginReceiveRemoteMessages(max, TimeSpan.FromMilliseconds(20), ...)``). The Python SDK
keeps pulling for 0.2 s after the first of several requested messages instead, which held every
batch call back ten times that long. So the first message is asked for alone (returned as soon as
it arrives) and the rest with a receive whose whole budget is the fill window.

The Python SDK checks its deadlines between socket reads, and a read with nothing to read blocks
for the connection's ``socket_timeout`` (0.2 s by default): every receive that ended empty lasted
0.2 s whatever its ``max_wait_time``, and now and then a settlement waited 0.2 s for an outcome the
broker had already sent, holding the trigger's one pump thread (and so the next message) that
long. Receivers opened with :func:`receiver_options` read with a 20 ms timeout; an idle trigger
pays for it with about 0.008 CPU-s/s more (BENCHMARKS.md, issue 31).
"""

from __future__ import annotations

from azure.servicebus import ServiceBusReceivedMessage, ServiceBusReceiver

__all__ = ["BATCH_FILL_SECONDS", "SOCKET_TIMEOUT_SECONDS", "receive_batch", "receiver_options"]

BATCH_FILL_SECONDS = 0.02
SOCKET_TIMEOUT_SECONDS = 0.02


def receiver_options() -> dict[str, float]:
    """Keywords for every trigger's receiver: the short socket read the waits above rely on."""
    return {"socket_timeout": SOCKET_TIMEOUT_SECONDS}


def receive_batch(receiver: ServiceBusReceiver, count: int, wait: float) -> list[ServiceBusReceivedMessage]:
    """Up to ``count`` messages: none after ``wait`` s without one, else what arrives within the fill window."""
    first = receiver.receive_messages(max_message_count=1, max_wait_time=wait)
    if not first or count <= 1:
        return first
    return first + receiver.receive_messages(max_message_count=count - 1, max_wait_time=BATCH_FILL_SECONDS)

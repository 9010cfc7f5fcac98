"""Small SDK helpers shared by the emulator tests."""

from __future__ import annotations

import time
import uuid

from azure.servicebus import ServiceBusClient, ServiceBusMessage, ServiceBusReceivedMessage


def send(client: ServiceBusClient, queue: str, *bodies: str | bytes, session_id: str | None = None) -> None:
    """Send each body as its own message (one sender link)."""
    with client.get_queue_sender(queue) as sender:
        sender.send_messages(
            [ServiceBusMessage(b, message_id=str(uuid.uuid4()), session_id=session_id) for b in bodies]
        )


def drain(
    client: ServiceBusClient, queue: str, n: int, timeout: float = 10.0, sub_queue: str | None = None
) -> list[ServiceBusReceivedMessage]:
    """Receive and complete ``n`` messages (fewer if the timeout passes)."""
    out: list[ServiceBusReceivedMessage] = []
    deadline = time.monotonic() + timeout
    with client.get_queue_receiver(queue, max_wait_time=1, sub_queue=sub_queue) as receiver:
        while len(out) < n and time.monotonic() < deadline:
            for m in receiver.receive_messages(n - len(out), max_wait_time=2):
                receiver.complete_message(m)
                out.append(m)
    return out

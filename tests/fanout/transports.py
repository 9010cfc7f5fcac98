"""The two transports behind one test interface: Service Bus (the emulator) and Storage Queues (Azurite)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any, Protocol

from azure.servicebus import ServiceBusClient, ServiceBusMessage, ServiceBusSubQueue
from azure.storage.queue import QueueServiceClient

from poller.ports import Sink
from poller.sinks.servicebus import ServiceBusSink
from poller.sinks.storagequeue import StorageQueueSink
from sbemulator import Emulator
from sbemulator.testing import unique_queue
from shared.config import PollerConfig
from shared.messages import OutgoingMessage
from shared.servicebus import QueueSender
from shared.storagequeue import StorageQueueSender, decode_queue_text, encode_queue_text, poison_queue_name
from worker.consumer import settle_received
from worker.queue_consumer import settle_queue_message
from worker.runtime import Worker


class Transport(Protocol):
    name: str
    queue: str

    def sink(self, poller: PollerConfig, **kwargs: Any) -> Sink: ...
    def send_all(self, queue: str, messages: list[OutgoingMessage]) -> None: ...
    def send_raw(self, body: bytes, message_id: str) -> None: ...
    def consume_until(self, worker: Worker, done: Callable[[], bool], timeout: float = 60.0) -> None: ...
    def pending(self) -> int: ...
    def dead(self) -> list[tuple[bytes, str]]: ...


def _deadline_loop(done: Callable[[], bool], timeout: float) -> Callable[[], bool]:
    deadline = time.monotonic() + timeout

    def keep_going() -> bool:
        if done():
            return False
        if time.monotonic() > deadline:
            raise TimeoutError("the pipeline did not reach the expected state in time")
        return True

    return keep_going


class ServiceBusTransport:
    name = "servicebus"

    def __init__(self, emulator: Emulator, client: ServiceBusClient, **queue_props: Any) -> None:
        props = {"requires_duplicate_detection": True, "lock_duration": "PT5S", "max_delivery_count": 3, **queue_props}
        self.emulator, self.client = emulator, client
        self.queue = unique_queue(emulator, "orders", **props)
        self._senders: dict[str, QueueSender] = {}

    def sink(self, poller: PollerConfig, **kwargs: Any) -> Sink:
        return ServiceBusSink(poller, QueueSender(self.client, poller.queue), **kwargs)

    def send_all(self, queue: str, messages: list[OutgoingMessage]) -> None:
        self._senders.setdefault(queue, QueueSender(self.client, queue)).send_all(messages)

    def send_raw(self, body: bytes, message_id: str) -> None:
        with self.client.get_queue_sender(self.queue) as sender:
            sender.send_messages(ServiceBusMessage(body, message_id=message_id))

    def consume_until(self, worker: Worker, done: Callable[[], bool], timeout: float = 60.0) -> None:
        keep_going = _deadline_loop(done, timeout)
        with self.client.get_queue_receiver(self.queue) as receiver:
            while keep_going():
                for msg in receiver.receive_messages(max_message_count=20, max_wait_time=0.5):
                    settle_received(receiver, msg, worker.process)

    def pending(self) -> int:
        return self.emulator.queue_stats(self.queue)["messages"]

    def active(self) -> int:
        return self.emulator.queue_stats(self.queue)["active"]

    def dead(self) -> list[tuple[bytes, str]]:
        with self.client.get_queue_receiver(self.queue, sub_queue=ServiceBusSubQueue.DEAD_LETTER) as dlq:
            messages = dlq.peek_messages(max_message_count=50)
            return [(b"".join(m.body), str(m.dead_letter_reason)) for m in messages]


class StorageQueueTransport:
    """Storage queues with the Functions queue trigger's rules: maxDequeueCount 3, then <queue>-poison."""

    name = "storage-queue"
    max_dequeue_count = 3

    def __init__(self, connection_string: str) -> None:
        self.service = QueueServiceClient.from_connection_string(connection_string)
        self.queue = f"orders-{uuid.uuid4().hex[:10]}"
        self.client = self.service.create_queue(self.queue)
        self.poison = self.service.create_queue(poison_queue_name(self.queue))

    def sink(self, poller: PollerConfig, **kwargs: Any) -> Sink:
        return StorageQueueSink(poller, StorageQueueSender(self.service.get_queue_client(poller.queue)), **kwargs)

    def send_all(self, queue: str, messages: list[OutgoingMessage]) -> None:
        StorageQueueSender(self.service.get_queue_client(queue)).send_all(messages)

    def send_raw(self, body: bytes, message_id: str) -> None:
        # Foreign producers: one writes base64 of garbage, one writes text that is not base64 at all
        self.client.send_message(encode_queue_text(body) if message_id != "not-base64" else "%% not base64 %%")

    def consume_until(self, worker: Worker, done: Callable[[], bool], timeout: float = 60.0) -> None:
        keep_going = _deadline_loop(done, timeout)
        while keep_going():
            for msg in self.client.receive_messages(messages_per_page=16, visibility_timeout=10, max_messages=16):
                settle_queue_message(
                    self.client, self.poison, msg, worker.process, max_dequeue_count=self.max_dequeue_count
                )

    def pending(self) -> int:
        return int(self.client.get_queue_properties().approximate_message_count or 0)

    def dead(self) -> list[tuple[bytes, str]]:
        out = []
        for m in self.poison.peek_messages(max_messages=32):
            try:
                out.append((decode_queue_text(m.content), "MaxDequeueCountExceeded"))
            except ValueError:
                out.append((str(m.content).encode(), "MaxDequeueCountExceeded"))
        return out

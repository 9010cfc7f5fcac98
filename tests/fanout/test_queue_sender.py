"""QueueSender's grouping against the project's emulator: messages that may share a batch go in one
transfer, a message that cannot goes alone, and either way every message arrives intact, in order.

The emulator's ``faults.send_counts`` counts the transfers (one per SDK batch or plain message).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from azure.servicebus import ServiceBusClient, ServiceBusReceivedMessage, ServiceBusReceiveMode

from sbemulator import Emulator
from sbemulator.testing import unique_queue
from shared.errors import OversizeRowError
from shared.messages import OutgoingMessage
from shared.servicebus import QueueSender

pytestmark = pytest.mark.integration


@pytest.fixture
def client(servicebus: Emulator) -> Iterator[ServiceBusClient]:
    with ServiceBusClient.from_connection_string(servicebus.connection_string) as client:
        yield client


def _message(i: int, size: int) -> OutgoingMessage:
    body = (f'{{"i":{i},"pad":"'.encode() + b"x" * size)[:size] + b'"}'
    return OutgoingMessage(
        message_id=f"m-{i}",
        body=body,
        subject="orders",
        event_ids=(f"ev-{i}",),
        application_properties={"dbfanout-poller": "orders", "events": 1},
    )


def _drain(client: ServiceBusClient, queue: str, count: int) -> list[ServiceBusReceivedMessage]:
    got: list[ServiceBusReceivedMessage] = []
    with client.get_queue_receiver(queue, receive_mode=ServiceBusReceiveMode.RECEIVE_AND_DELETE) as receiver:
        while len(got) < count:
            batch = receiver.receive_messages(max_message_count=count - len(got), max_wait_time=5)
            assert batch, f"only {len(got)} of {count} messages arrived"
            got.extend(batch)
    return got


def _assert_intact(got: list[ServiceBusReceivedMessage], sent: list[OutgoingMessage]) -> None:
    assert [m.message_id for m in got] == [m.message_id for m in sent]  # in order
    for received, message in zip(got, sent, strict=True):
        assert b"".join(received.body) == message.body
        assert received.subject == message.subject
        assert received.content_type == message.content_type
        props = received.application_properties or {}
        assert props[b"dbfanout-poller"] == b"orders" and props[b"events"] == 1


def test_messages_that_fit_together_go_in_one_transfer(servicebus: Emulator, client: ServiceBusClient) -> None:
    queue = unique_queue(servicebus, requires_duplicate_detection=True)
    sent = [_message(i, 2_000) for i in range(20)]
    sender = QueueSender(client, queue)
    sender.send_all(sent)
    sender.close()
    assert servicebus.faults.send_counts(queue)["accepted"] == 1
    _assert_intact(_drain(client, queue, len(sent)), sent)


def test_messages_that_cannot_share_a_batch_go_one_transfer_each(
    servicebus: Emulator, client: ServiceBusClient
) -> None:
    # Pages packed near the 256 KiB limit: no two bodies fit one batch.
    queue = unique_queue(servicebus, requires_duplicate_detection=True)
    sent = [_message(i, 150_000) for i in range(3)]
    sender = QueueSender(client, queue)
    sender.send_all(sent)
    sender.close()
    assert servicebus.faults.send_counts(queue)["accepted"] == 3
    _assert_intact(_drain(client, queue, len(sent)), sent)


def test_small_and_large_messages_mixed_arrive_intact_in_order(servicebus: Emulator, client: ServiceBusClient) -> None:
    queue = unique_queue(servicebus, requires_duplicate_detection=True)
    sizes = [1_000, 200_000, 1_000, 1_000, 250_000, 120_000, 120_000, 500]
    sent = [_message(i, size) for i, size in enumerate(sizes)]
    sender = QueueSender(client, queue)
    sender.send_all(sent)
    sender.close()
    assert servicebus.faults.send_counts(queue)["accepted"] < len(sent)  # some shared a batch
    _assert_intact(_drain(client, queue, len(sent)), sent)


def test_a_message_too_big_for_the_link_fails_as_oversize_and_the_sender_recovers(
    servicebus: Emulator, client: ServiceBusClient
) -> None:
    queue = unique_queue(servicebus, requires_duplicate_detection=True)
    sender = QueueSender(client, queue)
    with pytest.raises(OversizeRowError, match=f"queue {queue}"):
        sender.send_all([_message(0, 300_000)])
    after = [_message(1, 1_000)]
    sender.send_all(after)  # a fresh link after the failure
    sender.close()
    _assert_intact(_drain(client, queue, 1), after)

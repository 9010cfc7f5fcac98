"""Settlement: the decision after a handler ran, and what each transport's broker is told."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from azure.servicebus import (
    ServiceBusClient,
    ServiceBusMessage,
    ServiceBusReceivedMessage,
    ServiceBusReceiver,
    ServiceBusSubQueue,
)
from azure.servicebus.exceptions import ServiceBusError
from azure.storage.queue import QueueClient, QueueServiceClient

from sbemulator import Emulator
from sbemulator.testing import unique_queue
from tests.support.azurite import Azurite
from tests.support.faultproxy import FaultProxy
from tests.support.ports import wait_until
from worker.settlement import CRASH_MARGIN, Settle, decide, settle_bus, settle_queue, split_first


@pytest.mark.parametrize(
    ("ok", "n_events", "delivery_count", "expected"),
    [
        (True, 5, 1, Settle.COMPLETE),
        (True, 1, 9, Settle.COMPLETE),
        (False, 5, 1, Settle.RAISE),  # a batch is retried whole first (the failure may be transient)
        (False, 5, 2, Settle.SPLIT),  # from split_after_deliveries on, it is split
        (False, 5, 7, Settle.SPLIT),
        (False, 1, 1, Settle.RAISE),  # a single cannot be split: retried, then dead-lettered
        (False, 1, 9, Settle.RAISE),
    ],
)
def test_decide(ok: bool, n_events: int, delivery_count: int, expected: Settle) -> None:
    assert decide(ok, n_events, delivery_count, split_after=2) is expected


@pytest.mark.parametrize(
    ("delivery_count", "split_after", "max_deliveries", "expected"),
    [
        (1, 2, 3, Settle.SPLIT),  # two crashes after a retry would dead-letter the batch whole
        (1, 2, 4, Settle.RAISE),  # three deliveries left: room for a crash and the split
        (1, 5, 10, Settle.RAISE),
        (7, 5, 10, Settle.SPLIT),
        (7, 9, 10, Settle.RAISE),  # split_after alone would wait for the ninth delivery ...
        (8, 9, 10, Settle.SPLIT),  # ... but fewer than CRASH_MARGIN are left after the eighth
    ],
)
def test_a_failing_batch_close_to_max_delivery_count_is_split_at_once(
    delivery_count: int, split_after: int, max_deliveries: int, expected: Settle
) -> None:
    assert CRASH_MARGIN == 3  # the table is written for it
    assert decide(False, 5, delivery_count, split_after, max_deliveries) is expected
    assert decide(False, 1, delivery_count, split_after, max_deliveries) is Settle.RAISE


@pytest.mark.parametrize(
    ("n_events", "delivery_count", "max_deliveries", "expected"),
    [
        (5, 1, 3, False),  # a first delivery is always handled
        (5, 2, 3, True),  # a redelivery with one delivery left after it: split unhandled
        (1, 2, 3, False),  # a single cannot be split
        (5, 2, 10, False),  # room for crashes and a retry
        (5, 7, 10, False),
        (5, 8, 10, True),  # fewer than CRASH_MARGIN left after the eighth
    ],
)
def test_split_first_before_the_handler_runs_close_to_quarantine(
    n_events: int, delivery_count: int, max_deliveries: int, expected: bool
) -> None:
    assert CRASH_MARGIN == 3  # the table is written for it
    assert split_first(n_events, delivery_count, max_deliveries) is expected


# ---- Service Bus: complete on success, abandon on failure --------------------------------------
@pytest.fixture
def bus(servicebus: Emulator) -> Iterator[tuple[ServiceBusClient, str]]:
    queue = unique_queue(servicebus, "settle", max_delivery_count=2, lock_duration="PT30S")
    with ServiceBusClient.from_connection_string(servicebus.connection_string) as client:
        yield client, queue


@pytest.mark.integration
def test_success_completes_and_failure_abandons_until_dead_lettered(
    bus: tuple[ServiceBusClient, str], servicebus: Emulator
) -> None:
    client, queue = bus
    with client.get_queue_sender(queue) as sender:
        sender.send_messages([ServiceBusMessage(b"ok", message_id="m-ok"), ServiceBusMessage(b"x", message_id="m-bad")])
    with client.get_queue_receiver(queue) as receiver:
        # Given both messages received; When one succeeded and the other failed
        got = {str(m.message_id): m for m in _receive(receiver, 2)}
        assert settle_bus(receiver, [got["m-ok"]], None) == 1
        assert settle_bus(receiver, [got["m-bad"]], ValueError("boom")) == 1
        # Then only the failed one comes back, its delivery counted; a second failure dead-letters it
        (again,) = _receive(receiver, 1)
        assert (again.message_id, again.delivery_count) == ("m-bad", 1)
        assert settle_bus(receiver, [again], ValueError("boom")) == 1
    stats = servicebus.queue_stats(queue)
    assert (stats["messages"], stats["dead_lettered"]) == (0, 1)
    with client.get_queue_receiver(queue, sub_queue=ServiceBusSubQueue.DEAD_LETTER) as dlq:
        (dead,) = dlq.receive_messages(max_message_count=1, max_wait_time=5)
        assert dead.message_id == "m-bad"


@pytest.mark.integration
def test_a_lost_lock_is_reported_not_raised(servicebus: Emulator) -> None:
    queue = unique_queue(servicebus, "settle", lock_duration="PT1S")
    with ServiceBusClient.from_connection_string(servicebus.connection_string) as client:
        with client.get_queue_sender(queue) as sender:
            sender.send_messages(ServiceBusMessage(b"x", message_id="m-1"))
        with client.get_queue_receiver(queue) as receiver:
            (msg,) = _receive(receiver, 1)
            wait_until(lambda: msg._lock_expired, 30, "the lock to expire")
            # the broker redelivers it; settlement says so instead of failing the caller
            assert settle_bus(receiver, [msg], None) == 0


@pytest.mark.integration
def test_a_receiver_shut_down_by_a_lost_connection_is_reported_not_raised(servicebus: Emulator) -> None:
    # Given a message received through a connection that then breaks (the SDK shuts the receiver down)
    queue = unique_queue(servicebus, "settle")
    proxy = FaultProxy(servicebus.port)
    connection = servicebus.connection_string.replace(f":{servicebus.port};", f":{proxy.port};")
    try:
        with ServiceBusClient.from_connection_string(connection, retry_total=0) as client:
            with client.get_queue_sender(queue) as sender:
                sender.send_messages(ServiceBusMessage(b"x", message_id="m-1"))
            receiver = client.get_queue_receiver(queue)
            with receiver:
                (msg,) = _receive(receiver, 1)
                proxy.go_down()
                with pytest.raises(ServiceBusError):
                    receiver.receive_messages(max_message_count=1, max_wait_time=1)
                # When the finished call is settled on it (dbfanout run's pump did, and its thread died)
                # Then settlement reports it (the broker redelivers after the lock) instead of raising
                assert settle_bus(receiver, [msg], None) == 0
    finally:
        proxy.close()


def _receive(receiver: ServiceBusReceiver, n: int) -> list[ServiceBusReceivedMessage]:
    got: list[ServiceBusReceivedMessage] = []
    for _ in range(20):
        got += receiver.receive_messages(max_message_count=n - len(got), max_wait_time=1)
        if len(got) >= n:
            return got
    raise TimeoutError(f"received {len(got)} of {n} messages")


# ---- Storage queues: delete on success, visible again on failure, poison at maxDequeueCount -------
@pytest.fixture
def queues(azurite: Azurite) -> Iterator[tuple[QueueClient, QueueClient]]:
    service = QueueServiceClient.from_connection_string(azurite.connection_string)
    name = f"settle-{uuid.uuid4().hex[:10]}"
    main, poison = service.get_queue_client(name), service.get_queue_client(f"{name}-poison")
    main.create_queue()
    poison.create_queue()
    yield main, poison
    main.delete_queue()
    poison.delete_queue()


@pytest.mark.integration
def test_storage_queue_failures_retry_then_poison_and_success_deletes(queues: tuple[QueueClient, QueueClient]) -> None:
    main, poison = queues
    main.send_message("ok")
    main.send_message("bad")
    # When "ok" succeeds and "bad" fails on each of its two allowed dequeues
    for _ in range(3):
        (msg,) = main.receive_messages(max_messages=1, visibility_timeout=30)
        error = ValueError("boom") if msg.content == "bad" else None
        deleted = settle_queue(main, poison, msg, error, max_dequeue_count=2, visibility_timeout=0)
        assert deleted is (error is None)
    # Then the main queue is empty and the poison queue holds the failed message, once
    assert main.peek_messages(max_messages=32) == []
    assert [m.content for m in poison.peek_messages(max_messages=32)] == ["bad"]

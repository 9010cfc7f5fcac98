"""Send, receive and settle through the real SDK (sync client)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

import pytest
from azure.servicebus import ServiceBusClient, ServiceBusMessage, ServiceBusReceivedMessage, ServiceBusReceiveMode
from azure.servicebus.exceptions import (
    MessageLockLostError,
    MessageSizeExceededError,
    MessagingEntityNotFoundError,
    ServiceBusQuotaExceededError,
    ServiceBusServerBusyError,
)

from sbemulator import Emulator

pytestmark = pytest.mark.integration


def test_single_message_arrives_with_id_body_properties_and_sequence_number(client: ServiceBusClient, queue: str):
    # Given a message with id, subject, correlation id and application properties
    msg = ServiceBusMessage(
        b"hello", message_id="m-1", subject="greeting", correlation_id="c-1", application_properties={"k": "v"}
    )
    # When it is sent and received in peek-lock mode
    with client.get_queue_sender(queue) as sender:
        sender.send_messages(msg)
    with client.get_queue_receiver(queue, max_wait_time=5) as receiver:
        (got,) = receiver.receive_messages(max_message_count=1, max_wait_time=5)
        # Then every field round-trips and the broker stamps sequence number and lock
        assert b"".join(got.body) == b"hello"
        assert got.message_id == "m-1"
        assert got.subject == "greeting"
        assert got.correlation_id == "c-1"
        assert got.application_properties is not None and got.application_properties[b"k"] == b"v"
        assert got.sequence_number == 1
        assert got.delivery_count == 0
        assert got.lock_token is not None
        assert got.locked_until_utc is not None
        assert got.enqueued_time_utc is not None
        receiver.complete_message(got)


def test_batch_messages_are_enqueued_individually_in_order(client: ServiceBusClient, queue: str):
    # Given a batch of 100 messages
    with client.get_queue_sender(queue) as sender:
        batch = sender.create_message_batch()
        for i in range(100):
            batch.add_message(ServiceBusMessage(f"m{i}", message_id=f"id-{i}"))
        # When it is sent
        sender.send_messages(batch)
    # Then 100 separate messages arrive in order
    got = _drain(client, queue, 100)
    assert [str(m) for m in got] == [f"m{i}" for i in range(100)]
    assert [m.sequence_number for m in got] == list(range(1, 101))


def test_completed_message_is_gone(client: ServiceBusClient, queue: str, emulator: Emulator):
    # Given a received message
    _send(client, queue, "a")
    with client.get_queue_receiver(queue, max_wait_time=1) as receiver:
        (m,) = receiver.receive_messages(1, max_wait_time=5)
        # When it is completed
        receiver.complete_message(m)
        # Then nothing is left
        assert receiver.receive_messages(1, max_wait_time=0.5) == []
    assert emulator.queue_stats(queue)["messages"] == 0


def test_receive_and_delete_removes_on_delivery(client: ServiceBusClient, queue: str, emulator: Emulator):
    # Given two messages
    _send(client, queue, "a", "b")
    # When received in receive-and-delete mode
    with client.get_queue_receiver(
        queue, receive_mode=ServiceBusReceiveMode.RECEIVE_AND_DELETE, max_wait_time=1
    ) as receiver:
        got = receiver.receive_messages(2, max_wait_time=5)
    # Then they are gone without settlement and carry no lock
    assert sorted(str(m) for m in got) == ["a", "b"]
    assert emulator.queue_stats(queue)["messages"] == 0


def test_abandon_redelivers_with_delivery_count_plus_one(client: ServiceBusClient, queue: str):
    # Given a received message
    _send(client, queue, "x")
    with client.get_queue_receiver(queue, max_wait_time=1) as receiver:
        (m,) = receiver.receive_messages(1, max_wait_time=5)
        # When it is abandoned
        receiver.abandon_message(m)
        # Then it comes back with delivery count 1
        (again,) = receiver.receive_messages(1, max_wait_time=5)
        assert again.delivery_count == 1
        assert again.sequence_number == m.sequence_number
        receiver.complete_message(again)


def test_prefetched_messages_released_on_close_keep_their_delivery_count(client: ServiceBusClient, queue: str):
    # Given 5 messages and a receiver with prefetch that takes only one
    _send(client, queue, *[f"p{i}" for i in range(5)])
    with client.get_queue_receiver(queue, prefetch_count=10, max_wait_time=1) as receiver:
        (first,) = receiver.receive_messages(1, max_wait_time=5)
        receiver.complete_message(first)
    # When the receiver closes (releasing its prefetched messages)
    # Then the others are available at once, with delivery count still 0
    got = _drain(client, queue, 4)
    assert {m.delivery_count for m in got} == {0}


def test_lock_expiry_redelivers_after_lock_duration(client: ServiceBusClient, make_queue: Callable[..., str]):
    # Given a queue with a 2 s lock and a message that was received but not settled
    queue = make_queue(lock_duration="PT2S")
    _send(client, queue, "slow")
    with client.get_queue_receiver(queue, max_wait_time=1) as receiver:
        (m,) = receiver.receive_messages(1, max_wait_time=5)
        locked_at = time.monotonic()
        # When the lock expires
        (again,) = receiver.receive_messages(1, max_wait_time=10)
        waited = time.monotonic() - locked_at
        # Then it is redelivered with delivery count 1, about LockDuration later
        assert again.delivery_count == 1
        assert 1.5 <= waited <= 4.0
        # And the old lock is useless
        with pytest.raises(MessageLockLostError):
            receiver.complete_message(m)
        receiver.complete_message(again)


def test_max_delivery_count_moves_message_to_dead_letter_queue(client: ServiceBusClient, make_queue):
    # Given MaxDeliveryCount 2
    queue = make_queue(max_delivery_count=2)
    _send(client, queue, "poison")
    with client.get_queue_receiver(queue, max_wait_time=1) as receiver:
        # When the message is abandoned twice
        for _ in range(2):
            (m,) = receiver.receive_messages(1, max_wait_time=5)
            receiver.abandon_message(m)
        # Then the queue is empty
        assert receiver.receive_messages(1, max_wait_time=0.5) == []
    # And the dead-letter queue has it with reason MaxDeliveryCountExceeded
    with client.get_queue_receiver(queue, sub_queue="deadletter", max_wait_time=1) as dlq:
        (dead,) = dlq.receive_messages(1, max_wait_time=5)
        assert str(dead) == "poison"
        assert dead.dead_letter_reason == "MaxDeliveryCountExceeded"
        assert dead.delivery_count == 2
        dlq.complete_message(dead)


def test_dead_letter_carries_reason_and_description(client: ServiceBusClient, queue: str, emulator: Emulator):
    # Given a received message
    _send(client, queue, "bad")
    with client.get_queue_receiver(queue, max_wait_time=1) as receiver:
        (m,) = receiver.receive_messages(1, max_wait_time=5)
        # When it is dead-lettered with reason and description
        receiver.dead_letter_message(m, reason="Invalid", error_description="field x missing")
    # Then the DLQ can peek it and receive it with both fields, and complete it
    with client.get_queue_receiver(queue, sub_queue="deadletter", max_wait_time=1) as dlq:
        (peeked,) = dlq.peek_messages(1)
        assert peeked.dead_letter_reason == "Invalid"
        (dead,) = dlq.receive_messages(1, max_wait_time=5)
        assert (dead.dead_letter_reason, dead.dead_letter_error_description) == ("Invalid", "field x missing")
        assert dead.dead_letter_source == queue
        dlq.complete_message(dead)
    assert emulator.queue_stats(queue)["dead_lettered"] == 0


def test_duplicate_message_id_is_accepted_and_dropped(client: ServiceBusClient, make_queue, emulator: Emulator):
    # Given duplicate detection
    queue = make_queue(requires_duplicate_detection=True, duplicate_detection_history_time_window="PT1M")
    with client.get_queue_sender(queue) as sender:
        # When the same message id is sent twice, and again twice inside a batch
        sender.send_messages(ServiceBusMessage("one", message_id="dup"))
        sender.send_messages(ServiceBusMessage("two", message_id="dup"))
        batch = sender.create_message_batch()
        for body, mid in (("three", "b"), ("four", "b"), ("five", "dup"), ("six", "c")):
            batch.add_message(ServiceBusMessage(body, message_id=mid))
        sender.send_messages(batch)
    # Then each id is stored once (first wins); no error was raised
    got = _drain(client, queue, 3)
    assert [str(m) for m in got] == ["one", "three", "six"]
    assert emulator.queue_stats(queue)["messages"] == 0


def test_duplicates_are_kept_without_duplicate_detection(client: ServiceBusClient, queue: str):
    # Given a queue without duplicate detection; When an id is sent twice; Then both arrive
    _send(client, queue, "a", "b", message_id="same")
    assert len(_drain(client, queue, 2)) == 2


def test_oversized_message_is_refused_with_message_size_exceeded(client: ServiceBusClient, queue: str):
    # Given the default 256 KB limit; When a 300 KB message is sent
    with client.get_queue_sender(queue) as sender, pytest.raises(MessageSizeExceededError):
        sender.send_messages(ServiceBusMessage(b"x" * 300_000))
        # Then the SDK raises MessageSizeExceededError


def test_premium_sized_queue_accepts_a_one_megabyte_message(client: ServiceBusClient, make_queue):
    # Given a queue with a 2 MB limit (Premium-like)
    queue = make_queue(max_message_size=2 * 1024 * 1024)
    # When a 1 MB message is sent; Then it round-trips
    _send(client, queue, b"y" * 1_000_000)
    (m,) = _drain(client, queue, 1)
    assert len(b"".join(m.body)) == 1_000_000


def test_unknown_queue_raises_entity_not_found_for_sender_and_receiver(client: ServiceBusClient):
    # Given no queue named "missing"; When a sender or receiver uses it; Then MessagingEntityNotFoundError
    with pytest.raises(MessagingEntityNotFoundError), client.get_queue_sender("missing") as sender:
        sender.send_messages(ServiceBusMessage("x"))
    with pytest.raises(MessagingEntityNotFoundError), client.get_queue_receiver("missing") as receiver:
        receiver.receive_messages(1, max_wait_time=1)


def test_full_queue_refuses_with_quota_exceeded(client: ServiceBusClient, make_queue):
    # Given a queue limited to 64 KB
    queue = make_queue(max_size_bytes=64 * 1024, max_message_size=32 * 1024)
    with client.get_queue_sender(queue) as sender:
        for _ in range(3):
            sender.send_messages(ServiceBusMessage(b"z" * 20_000))
        # When one more 20 KB message is sent; Then ServiceBusQuotaExceededError
        with pytest.raises(ServiceBusQuotaExceededError):
            sender.send_messages(ServiceBusMessage(b"z" * 20_000))


def test_full_queue_refuses_with_service_bus_text_and_keeps_refusing_until_it_drains(
    client: ServiceBusClient, make_queue, emulator: Emulator
):
    # Given a queue filled to its quota
    queue = make_queue(max_size_bytes=64 * 1024, max_message_size=32 * 1024)
    with client.get_queue_sender(queue) as sender:
        for _ in range(3):
            sender.send_messages(ServiceBusMessage(b"z" * 20_000))
        # When two more sends follow; Then each is refused as Service Bus refuses a full entity
        for _ in range(2):
            with pytest.raises(ServiceBusQuotaExceededError) as refused:
                sender.send_messages(ServiceBusMessage(b"z" * 20_000))
            text = str(refused.value)
            assert f"The maximum entity size has been reached or exceeded for Queue: '{queue}'." in text, text
            assert "Max entity size in bytes: 65536" in text and "https://aka.ms/ServiceBusExceptions" in text
        # And once a message was received, the next send is accepted
        _drain(client, queue, 1)
        sender.send_messages(ServiceBusMessage(b"z" * 20_000))
    # And the emulator counted every transfer: 4 accepted, 2 refused
    assert emulator.faults.send_counts(queue) == {"accepted": 4, "refused": 2}


def test_throttle_refuses_every_send_with_server_busy_until_unthrottled(
    client: ServiceBusClient, make_queue, emulator: Emulator
):
    # Given a throttled queue (an emulator-only test knob) next to one that is not
    queue, other = make_queue(), make_queue()
    emulator.faults.throttle(queue)
    try:
        with client.get_queue_sender(queue) as sender:
            # When it is sent to twice; Then both sends fail with ServerBusy and Service Bus's text
            for _ in range(2):
                with pytest.raises(ServiceBusServerBusyError, match="entity is being throttled"):
                    sender.send_messages(ServiceBusMessage("a"))
            _send(client, other, "not throttled")  # the other queue accepts
            # And after unthrottle the next send is accepted
            emulator.faults.unthrottle()
            sender.send_messages(ServiceBusMessage("b"))
    finally:
        emulator.faults.unthrottle()
    assert [str(m) for m in _drain(client, queue, 1)] == ["b"]
    assert emulator.faults.send_counts(queue) == {"accepted": 1, "refused": 2}


def test_injected_server_busy_fault_surfaces_once(client: ServiceBusClient, queue: str, emulator: Emulator):
    # Given one injected server-busy refusal
    emulator.faults.reject_next_sends(1)
    with client.get_queue_sender(queue) as sender:
        # When two sends follow; Then the first fails with ServiceBusServerBusyError, the second succeeds
        with pytest.raises(ServiceBusServerBusyError):
            sender.send_messages(ServiceBusMessage("a"))
        sender.send_messages(ServiceBusMessage("b"))
    assert [str(m) for m in _drain(client, queue, 1)] == ["b"]


def _send(client: ServiceBusClient, queue: str, *bodies: str | bytes, message_id: str | None = None) -> None:
    with client.get_queue_sender(queue) as sender:
        sender.send_messages([ServiceBusMessage(b, message_id=message_id or str(uuid.uuid4())) for b in bodies])


def _drain(client: ServiceBusClient, queue: str, n: int, timeout: float = 10.0) -> list[ServiceBusReceivedMessage]:
    out: list[ServiceBusReceivedMessage] = []
    deadline = time.monotonic() + timeout
    with client.get_queue_receiver(queue, max_wait_time=1) as receiver:
        while len(out) < n and time.monotonic() < deadline:
            for m in receiver.receive_messages(n - len(out), max_wait_time=2):
                receiver.complete_message(m)
                out.append(m)
    return out

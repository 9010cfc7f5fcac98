"""$management operations, scheduling, deferral and TTL through the real SDK."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta

import pytest
from azure.servicebus import ServiceBusClient, ServiceBusMessage, ServiceBusMessageState
from azure.servicebus.exceptions import MessageLockLostError

from sbemulator import Emulator
from sbemulator.testing import wait_until

from .helpers import drain, send

pytestmark = pytest.mark.integration


def test_renew_lock_extends_locked_until(client: ServiceBusClient, make_queue):
    # Given a message locked for 3 s
    queue = make_queue(lock_duration="PT3S")
    send(client, queue, "m")
    with client.get_queue_receiver(queue, max_wait_time=1) as receiver:
        (m,) = receiver.receive_messages(1, max_wait_time=5)
        first = m.locked_until_utc
        # When the lock is renewed after 2 s, and the message completed at 4 s
        time.sleep(2)  # the point of the test is the passage of time across the original expiry
        new_until = receiver.renew_message_lock(m)
        assert first is not None and new_until > first
        time.sleep(2)
        # Then completion still succeeds (the lock would have expired at 3 s)
        receiver.complete_message(m)


def test_renew_lock_on_expired_lock_raises_lock_lost(client: ServiceBusClient, make_queue):
    # Given a 1 s lock that expired and a redelivery that took the message
    queue = make_queue(lock_duration="PT1S")
    send(client, queue, "m")
    with client.get_queue_receiver(queue, max_wait_time=1) as receiver:
        (m,) = receiver.receive_messages(1, max_wait_time=5)
        (again,) = receiver.receive_messages(1, max_wait_time=5)
        assert again.delivery_count == 1
        # When the old lock is renewed; Then MessageLockLostError
        m._locked_until_utc = datetime.now(UTC) + timedelta(minutes=1)  # type: ignore[attr-defined]  # bypass the SDK's own check
        with pytest.raises(MessageLockLostError):
            receiver.renew_message_lock(m)
        receiver.complete_message(again)


def test_peek_returns_messages_without_locking_from_a_sequence_number(client: ServiceBusClient, queue: str):
    # Given five messages
    send(client, queue, *[f"m{i}" for i in range(5)])
    with client.get_queue_receiver(queue, max_wait_time=1) as receiver:
        # When peeking 3 from sequence number 2
        peeked = receiver.peek_messages(3, sequence_number=2)
        # Then messages 2..4 come back, unlocked, and all five are still receivable
        assert [m.sequence_number for m in peeked] == [2, 3, 4]
        assert [str(m) for m in peeked] == ["m1", "m2", "m3"]
        assert receiver.peek_messages(10, sequence_number=100) == []
    assert len(drain(client, queue, 5)) == 5


def test_deferred_message_is_only_received_by_sequence_number(client: ServiceBusClient, queue: str):
    # Given a deferred message
    send(client, queue, "later")
    with client.get_queue_receiver(queue, max_wait_time=1) as receiver:
        (m,) = receiver.receive_messages(1, max_wait_time=5)
        seq = m.sequence_number
        receiver.defer_message(m)
        # When receiving normally; Then nothing comes
        assert receiver.receive_messages(1, max_wait_time=0.5) == []
        # When receiving by sequence number; Then it comes, marked deferred, and can be completed
        assert seq is not None
        (d,) = receiver.receive_deferred_messages([seq])
        assert str(d) == "later"
        assert d.state == ServiceBusMessageState.DEFERRED
        receiver.complete_message(d)
        assert receiver.peek_messages(1) == []


def test_deferred_message_can_be_dead_lettered(client: ServiceBusClient, queue: str):
    # Given a deferred message received by sequence number
    send(client, queue, "d")
    with client.get_queue_receiver(queue, max_wait_time=1) as receiver:
        (m,) = receiver.receive_messages(1, max_wait_time=5)
        receiver.defer_message(m)
        assert m.sequence_number is not None
        (d,) = receiver.receive_deferred_messages([m.sequence_number])
        # When it is dead-lettered (via update-disposition)
        receiver.dead_letter_message(d, reason="r", error_description="e")
    # Then it is in the DLQ with reason and description
    (dead,) = drain(client, queue, 1, sub_queue="deadletter")
    assert (dead.dead_letter_reason, dead.dead_letter_error_description) == ("r", "e")


def test_scheduled_message_appears_at_its_time(client: ServiceBusClient, queue: str):
    # Given a message scheduled 2 s ahead
    with client.get_queue_sender(queue) as sender:
        when = datetime.now(UTC) + timedelta(seconds=2)
        (seq,) = sender.schedule_messages(ServiceBusMessage("tick"), when)
        assert seq >= 1
    with client.get_queue_receiver(queue, max_wait_time=1) as receiver:
        # When receiving at once; Then nothing, but peek shows it as scheduled
        assert receiver.receive_messages(1, max_wait_time=0.3) == []
        (peeked,) = receiver.peek_messages(1)
        assert peeked.state == ServiceBusMessageState.SCHEDULED
        # When waiting; Then it arrives no earlier than its time
        (m,) = receiver.receive_messages(1, max_wait_time=10)
        assert datetime.now(UTC) >= when - timedelta(milliseconds=100)
        assert m.sequence_number == seq
        receiver.complete_message(m)


def test_cancelled_scheduled_message_never_arrives(client: ServiceBusClient, queue: str, emulator: Emulator):
    # Given a message scheduled 1 s ahead
    with client.get_queue_sender(queue) as sender:
        (seq,) = sender.schedule_messages(ServiceBusMessage("no"), datetime.now(UTC) + timedelta(seconds=1))
        # When it is cancelled
        sender.cancel_scheduled_messages(seq)
    # Then the queue is empty, also after its time
    assert emulator.queue_stats(queue)["messages"] == 0
    with client.get_queue_receiver(queue, max_wait_time=1) as receiver:
        assert receiver.receive_messages(1, max_wait_time=1.5) == []


def test_scheduling_through_the_message_property(client: ServiceBusClient, queue: str):
    # Given a message with scheduled_enqueue_time_utc 1 s ahead, sent normally
    with client.get_queue_sender(queue) as sender:
        when = datetime.now(UTC) + timedelta(seconds=1)
        sender.send_messages(ServiceBusMessage("s", scheduled_enqueue_time_utc=when))
    # When receiving; Then it arrives after its time
    (m,) = drain(client, queue, 1)
    assert datetime.now(UTC) >= when - timedelta(milliseconds=100)
    assert str(m) == "s"


def test_expired_message_is_dropped(client: ServiceBusClient, queue: str, emulator: Emulator):
    # Given a message with a 1 s time-to-live
    with client.get_queue_sender(queue) as sender:
        sender.send_messages(ServiceBusMessage("old", time_to_live=timedelta(seconds=1)))
    # When it expires; Then it is gone and not dead-lettered
    wait_until(lambda: emulator.queue_stats(queue)["messages"] == 0, timeout=5)
    assert emulator.queue_stats(queue)["dead_lettered"] == 0


def test_expired_message_is_dead_lettered_when_configured(client: ServiceBusClient, make_queue):
    # Given DeadLetteringOnMessageExpiration and a DefaultMessageTimeToLive of 1 s
    queue = make_queue(dead_lettering_on_message_expiration=True, default_message_time_to_live="PT1S")
    send(client, queue, "stale")
    # When it expires; Then the DLQ holds it with reason TTLExpiredException
    (dead,) = drain(client, queue, 1, sub_queue="deadletter")
    assert str(dead) == "stale"
    assert dead.dead_letter_reason == "TTLExpiredException"

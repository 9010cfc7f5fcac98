"""Behaviours where the emulator must match the real service, each driven by the unmodified SDK."""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import uuid

import pytest
from azure.servicebus import AutoLockRenewer, ServiceBusClient, ServiceBusMessage, ServiceBusReceivedMessage
from azure.servicebus.aio import AutoLockRenewer as AsyncAutoLockRenewer
from azure.servicebus.aio import ServiceBusClient as AsyncServiceBusClient
from azure.servicebus.amqp import AmqpAnnotatedMessage
from azure.servicebus.exceptions import ServiceBusError

from sbemulator import Emulator
from sbemulator.testing import wait_until

pytestmark = pytest.mark.integration
RENEWED_MESSAGES = 12


def _send_many(client: ServiceBusClient, queue: str, n: int) -> None:
    with client.get_queue_sender(queue) as sender:
        sender.send_messages([ServiceBusMessage(f"m{i}") for i in range(n)])


def _renewed_twice(m: ServiceBusReceivedMessage, first_until: dict[int | None, dt.datetime | None]) -> bool:
    """True once the message's lock reaches 3 s (more than one 5 s-lock renewal) past its first expiry."""
    first, now = first_until[m.sequence_number], m.locked_until_utc
    return first is not None and now is not None and now > first + dt.timedelta(seconds=3)


def test_auto_lock_renewer_renews_many_locks_at_once_without_killing_the_connection(
    client: ServiceBusClient, make_queue, caplog: pytest.LogCaptureFixture
):
    # Given a dozen locked messages on a queue with a 5 s lock (the renewer renews them all, from
    # several threads, on one management link: the SDK's delivery-ids then repeat)
    queue = make_queue(lock_duration="PT5S")
    _send_many(client, queue, RENEWED_MESSAGES)
    renewer = AutoLockRenewer(max_lock_renewal_duration=60, max_workers=8)
    caplog.set_level(logging.WARNING, logger="sbemulator")
    with client.get_queue_receiver(queue, max_wait_time=5) as receiver:
        got: list[ServiceBusReceivedMessage] = []
        while len(got) < RENEWED_MESSAGES:
            got += receiver.receive_messages(RENEWED_MESSAGES - len(got), max_wait_time=5)
        first_until = {m.sequence_number: m.locked_until_utc for m in got}
        for m in got:
            renewer.register(receiver, m)
        # When the locks have been renewed at least twice past their first expiry (the wait returns
        # once they are; its 50 s bound is for a loaded machine)
        wait_until(lambda: all(_renewed_twice(m, first_until) for m in got), timeout=50)
        # Then every message can still be completed: the connection survived
        for m in got:
            receiver.complete_message(m)
    renewer.close()
    assert not [r for r in caplog.records if "sequencing error" in r.getMessage()]


def test_async_auto_lock_renewer_renews_many_locks_at_once(emulator: Emulator, make_queue):
    queue = make_queue(lock_duration="PT5S")

    async def scenario() -> None:
        async with AsyncServiceBusClient.from_connection_string(emulator.connection_string, retry_total=0) as client:
            async with client.get_queue_sender(queue) as sender:
                await sender.send_messages([ServiceBusMessage(f"m{i}") for i in range(RENEWED_MESSAGES)])
            renewer = AsyncAutoLockRenewer(max_lock_renewal_duration=60)
            async with client.get_queue_receiver(queue, max_wait_time=5) as receiver:
                got: list[ServiceBusReceivedMessage] = []
                while len(got) < RENEWED_MESSAGES:
                    got += await receiver.receive_messages(RENEWED_MESSAGES - len(got), max_wait_time=5)
                first_until = {m.sequence_number: m.locked_until_utc for m in got}
                for m in got:
                    renewer.register(receiver, m)
                deadline = asyncio.get_running_loop().time() + 50  # the bound is for a loaded machine
                while not all(_renewed_twice(m, first_until) for m in got):
                    assert asyncio.get_running_loop().time() < deadline, "locks were not renewed"
                    await asyncio.sleep(0.05)  # yields to the renewer's tasks on this loop
                for m in got:
                    await receiver.complete_message(m)
            await renewer.close()

    asyncio.run(scenario())


def test_receiver_without_session_on_a_session_queue_is_refused(client: ServiceBusClient, make_queue):
    # Given a queue that requires sessions, holding a session message
    queue = make_queue(requires_session=True)
    with client.get_queue_sender(queue) as sender:
        sender.send_messages(ServiceBusMessage("s", session_id="s1"))
    # When a plain (non-session) receiver opens on it, Then the service refuses the link
    with (
        pytest.raises(ServiceBusError, match="requires sessions"),
        client.get_queue_receiver(queue, max_wait_time=2) as receiver,
    ):
        receiver.receive_messages(1, max_wait_time=2)


def test_scheduled_message_is_enqueued_when_it_becomes_available(client: ServiceBusClient, queue: str):
    # Given a message scheduled 3 s ahead
    due = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=3)
    with client.get_queue_sender(queue) as sender:
        sender.schedule_messages(ServiceBusMessage("later"), due)
    # When it arrives
    with client.get_queue_receiver(queue, max_wait_time=10) as receiver:
        (got,) = receiver.receive_messages(1, max_wait_time=10)
        receiver.complete_message(got)
    # Then its enqueued time is when it became available, not when it was scheduled
    assert got.enqueued_time_utc is not None
    assert got.enqueued_time_utc >= due - dt.timedelta(milliseconds=5)


def test_delivery_annotations_and_lock_token_annotation_are_delivered(client: ServiceBusClient, queue: str):
    # Given a message whose sender sets delivery annotations
    raw = AmqpAnnotatedMessage(data_body=b"x", delivery_annotations={"x-custom": "kept"})
    with client.get_queue_sender(queue) as sender:
        sender.send_messages(raw)
    with client.get_queue_receiver(queue, max_wait_time=5) as receiver:
        (got,) = receiver.receive_messages(1, max_wait_time=5)
        lock_token = uuid.UUID(str(got.lock_token))
        receiver.complete_message(got)
    # Then they arrive, with the lock token as the service sends it, next to the broker's stamps
    annotations = got.raw_amqp_message.delivery_annotations or {}
    assert annotations[b"x-custom"] == b"kept"
    assert annotations[b"x-opt-lock-token"] == lock_token
    stamped = got.raw_amqp_message.annotations or {}
    for key in (b"x-opt-sequence-number", b"x-opt-enqueued-time", b"x-opt-locked-until"):
        assert key in stamped


def test_peeked_messages_carry_no_lock_token(client: ServiceBusClient, queue: str):
    with client.get_queue_sender(queue) as sender:
        sender.send_messages(ServiceBusMessage("p"))
    with client.get_queue_receiver(queue) as receiver:
        (peeked,) = receiver.peek_messages(1)
    assert b"x-opt-lock-token" not in (peeked.raw_amqp_message.delivery_annotations or {})

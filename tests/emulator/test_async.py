"""The same semantics through the SDK's async client."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

import pytest
from azure.servicebus import ServiceBusMessage
from azure.servicebus.aio import ServiceBusClient
from azure.servicebus.exceptions import MessageSizeExceededError, MessagingEntityNotFoundError

from sbemulator import Emulator

pytestmark = pytest.mark.integration


T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T]) -> T:  # no pytest-asyncio in the venv: drive each scenario with asyncio.run
    return asyncio.run(coro)


def test_async_send_batch_receive_abandon_complete(emulator: Emulator, queue: str):
    async def scenario() -> None:
        async with ServiceBusClient.from_connection_string(emulator.connection_string, retry_total=0) as client:
            # Given a batch of three messages sent with the async sender
            async with client.get_queue_sender(queue) as sender:
                batch = await sender.create_message_batch()
                for i in range(3):
                    batch.add_message(ServiceBusMessage(f"a{i}", message_id=f"id{i}"))
                await sender.send_messages(batch)
            async with client.get_queue_receiver(queue, max_wait_time=1) as receiver:
                # When one is abandoned and all are completed
                got = await receiver.receive_messages(3, max_wait_time=5)
                assert [str(m) for m in got] == ["a0", "a1", "a2"]
                await receiver.abandon_message(got[0])
                for m in got[1:]:
                    await receiver.complete_message(m)
                (again,) = await receiver.receive_messages(1, max_wait_time=5)
                # Then the abandoned one returns with delivery count 1
                assert (str(again), again.delivery_count) == ("a0", 1)
                await receiver.complete_message(again)

    run(scenario())


def test_async_dead_letter_and_dlq_receive(emulator: Emulator, queue: str):
    async def scenario() -> None:
        async with ServiceBusClient.from_connection_string(emulator.connection_string, retry_total=0) as client:
            # Given a dead-lettered message
            async with client.get_queue_sender(queue) as sender:
                await sender.send_messages(ServiceBusMessage("bad"))
            async with client.get_queue_receiver(queue, max_wait_time=1) as receiver:
                (m,) = await receiver.receive_messages(1, max_wait_time=5)
                await receiver.dead_letter_message(m, reason="R", error_description="D")
            # When the DLQ is read; Then reason and description are there
            async with client.get_queue_receiver(queue, sub_queue="deadletter", max_wait_time=1) as dlq:
                (dead,) = await dlq.receive_messages(1, max_wait_time=5)
                assert (dead.dead_letter_reason, dead.dead_letter_error_description) == ("R", "D")
                await dlq.complete_message(dead)

    run(scenario())


def test_async_refusals_map_to_sdk_errors(emulator: Emulator, queue: str):
    async def scenario() -> None:
        async with ServiceBusClient.from_connection_string(emulator.connection_string, retry_total=0) as client:
            # Given an unknown queue and an oversized message; When sent; Then the SDK's exceptions
            with pytest.raises(MessagingEntityNotFoundError):
                async with client.get_queue_sender("no-such-queue") as sender:
                    await sender.send_messages(ServiceBusMessage("x"))
            async with client.get_queue_sender(queue) as sender:
                with pytest.raises(MessageSizeExceededError):
                    await sender.send_messages(ServiceBusMessage(b"x" * 300_000))

    run(scenario())


def test_async_receive_and_renew_lock_and_peek(emulator: Emulator, make_queue):
    queue = make_queue(lock_duration="PT5S")

    async def scenario() -> None:
        async with ServiceBusClient.from_connection_string(emulator.connection_string, retry_total=0) as client:
            async with client.get_queue_sender(queue) as sender:
                await sender.send_messages([ServiceBusMessage("p1"), ServiceBusMessage("p2")])
            async with client.get_queue_receiver(queue, max_wait_time=1) as receiver:
                # Given two messages; When peeking; Then both are visible without locks
                peeked = await receiver.peek_messages(5)
                assert [str(m) for m in peeked] == ["p1", "p2"]
                # When one is received and its lock renewed; Then the new expiry is later
                (m,) = await receiver.receive_messages(1, max_wait_time=5)
                before = m.locked_until_utc
                await asyncio.sleep(0.1)
                after = await receiver.renew_message_lock(m)
                assert after is not None and before is not None and after > before
                await receiver.complete_message(m)

    run(scenario())

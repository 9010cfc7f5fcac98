"""Sessions: specific and next-available, locks, state, listing."""

from __future__ import annotations

import time

import pytest
from azure.servicebus import NEXT_AVAILABLE_SESSION, ServiceBusClient, ServiceBusSubQueue
from azure.servicebus.exceptions import OperationTimeoutError, SessionCannotBeLockedError

from sbemulator import Emulator

from .helpers import send

pytestmark = pytest.mark.integration


@pytest.fixture
def session_queue(make_queue) -> str:
    name: str = make_queue(requires_session=True, lock_duration="PT5S")
    return name


def test_session_receiver_gets_only_its_session_in_order(client: ServiceBusClient, session_queue: str):
    # Given messages of two sessions
    send(client, session_queue, "a1", "a2", session_id="A")
    send(client, session_queue, "b1", session_id="B")
    # When receiving session A
    with client.get_queue_receiver(session_queue, session_id="A", max_wait_time=1) as receiver:
        got = receiver.receive_messages(5, max_wait_time=2)
        # Then only A's messages arrive, in order, with their session id
        assert [str(m) for m in got] == ["a1", "a2"]
        assert {m.session_id for m in got} == {"A"}
        assert receiver.session.session_id == "A"
        assert receiver.session.locked_until_utc is not None
        for m in got:
            receiver.complete_message(m)


def test_next_available_session_locks_a_session_with_messages(client: ServiceBusClient, session_queue: str):
    # Given messages only in session "only"
    send(client, session_queue, "x", session_id="only")
    # When accepting the next available session
    with client.get_queue_receiver(session_queue, session_id=NEXT_AVAILABLE_SESSION, max_wait_time=5) as receiver:
        # Then that session is locked and its message received
        assert receiver.session.session_id == "only"
        (m,) = receiver.receive_messages(1, max_wait_time=2)
        receiver.complete_message(m)


def test_next_available_session_times_out_when_none_has_messages(emulator: Emulator, session_queue: str):
    # Given no messages; When accepting the next available session with a 1 s wait
    with ServiceBusClient.from_connection_string(emulator.connection_string, retry_total=0) as client:
        started = time.monotonic()
        with (
            pytest.raises(OperationTimeoutError),
            client.get_queue_receiver(session_queue, session_id=NEXT_AVAILABLE_SESSION, max_wait_time=1) as receiver,
        ):
            receiver.receive_messages(1, max_wait_time=1)
        # Then OperationTimeoutError after about the wait time
        assert time.monotonic() - started < 10


def test_locked_session_cannot_be_accepted_twice(client: ServiceBusClient, session_queue: str):
    # Given session S held by one receiver
    send(client, session_queue, "s", session_id="S")
    with client.get_queue_receiver(session_queue, session_id="S", max_wait_time=1) as holder:
        holder.receive_messages(1, max_wait_time=2)
        # When a second receiver asks for S; Then SessionCannotBeLockedError
        with (
            pytest.raises(SessionCannotBeLockedError),
            client.get_queue_receiver(session_queue, session_id="S", max_wait_time=1) as other,
        ):
            other.receive_messages(1, max_wait_time=1)


def test_session_state_round_trips_and_lock_renews(client: ServiceBusClient, session_queue: str):
    # Given a locked session
    send(client, session_queue, "m", session_id="st")
    with client.get_queue_receiver(session_queue, session_id="st", max_wait_time=1) as receiver:
        session = receiver.session
        # When state is set and the lock renewed
        session.set_state(b"checkpoint-7")
        before = session.locked_until_utc
        time.sleep(0.2)  # so the renewed expiry is measurably later
        after = session.renew_lock()
        # Then the state reads back and the lock moved forward
        assert session.get_state() == b"checkpoint-7"
        assert after is not None and before is not None and after > before
        for m in receiver.receive_messages(1, max_wait_time=2):
            receiver.complete_message(m)


def test_closing_a_session_receiver_releases_the_session(client: ServiceBusClient, session_queue: str):
    # Given a receiver that took a session message without settling it, then closed
    send(client, session_queue, "again", session_id="R")
    with client.get_queue_receiver(session_queue, session_id="R", max_wait_time=1) as receiver:
        (_unsettled,) = receiver.receive_messages(1, max_wait_time=2)
    # When another receiver accepts the session; Then it gets the message again
    with client.get_queue_receiver(session_queue, session_id="R", max_wait_time=1) as receiver:
        (again,) = receiver.receive_messages(1, max_wait_time=2)
        assert str(again) == "again"
        receiver.complete_message(again)


def test_list_sessions_names_sessions_with_messages(emulator: Emulator, client: ServiceBusClient, session_queue):
    # Given messages in sessions s1 and s2
    send(client, session_queue, "1", session_id="s1")
    send(client, session_queue, "2", session_id="s2")
    # When listing sessions; Then both are named
    assert set(client.list_queue_sessions(session_queue)) == {"s1", "s2"}


def test_the_dead_letter_queue_of_a_session_queue_is_received_without_a_session(
    client: ServiceBusClient, session_queue: str
):
    # Given a message of session "A" dead-lettered (the DLQ is never session-enabled on the service)
    send(client, session_queue, "x", session_id="A")
    with client.get_queue_receiver(session_queue, session_id="A", max_wait_time=1) as receiver:
        (message,) = receiver.receive_messages(1, max_wait_time=5)
        receiver.dead_letter_message(message, reason="test")
    # When a plain receiver receives from the DLQ
    with client.get_queue_receiver(session_queue, sub_queue=ServiceBusSubQueue.DEAD_LETTER) as receiver:
        got = receiver.receive_messages(5, max_wait_time=5)
        # Then the message arrives, still carrying its session id
        assert [(str(m), m.session_id) for m in got] == [("x", "A")]
        receiver.complete_message(got[0])

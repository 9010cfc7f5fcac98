"""Broker semantics without AMQP: time is passed explicitly, so no waiting."""

from __future__ import annotations

import inspect

import pytest

import sbemulator
from sbemulator import ConfigError, EmulatorConfig, QueueProperties
from sbemulator.broker import Broker, EntityPath
from sbemulator.config import parse_duration
from sbemulator.entities import IncomingMessage, MessageState
from sbemulator.errors import (
    EntityNotFoundError,
    MessageLockLostError,
    MessageSizeExceededError,
    QuotaExceededError,
    SessionCannotBeLockedError,
)
from sbemulator.queue import Queue


def msg(body: bytes = b"x", **kw) -> IncomingMessage:
    return IncomingMessage(body, **kw)


def test_package_exports_exactly_all():
    names = {n for n, v in vars(sbemulator).items() if not n.startswith("_") and not inspect.ismodule(v)}
    assert set(sbemulator.__all__) == names


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("PT1M", 60), ("PT5S", 5), ("P1DT2H", 93600), ("PT0.5S", 0.5), ("00:01:30", 90), ("1.00:00:00", 86400)],
)
def test_durations_parse_iso8601_and_timespan(text: str, seconds: float):
    assert parse_duration(text) == seconds


def test_official_config_with_comments_and_defaults_parses():
    # Given the official sample, with comments and a property left out
    text = """{ "UserConfig": { "Namespaces": [ { "Name": "sbemulatorns", // the only namespace
        "Queues": [ { "Name": "queue.1", "Properties": { "LockDuration": "PT1M", "MaxDeliveryCount": 3,
        "ForwardTo": "", "RequiresSession": false /* block comment */ } } ], "Topics": [] } ],
        "Logging": { "Type": "File" } } }"""
    # When parsed; Then given values are used and the rest are the official defaults
    config = EmulatorConfig.from_json_text(text)
    props = config.queues[0].properties
    assert (config.queues[0].name, props.max_delivery_count, props.lock_duration) == ("queue.1", 3, 60.0)
    assert props.default_message_time_to_live == QueueProperties().default_message_time_to_live
    assert props.max_message_size == 256 * 1024


def test_config_errors_name_the_key():
    with pytest.raises(ConfigError, match="LockDurationX"):
        EmulatorConfig.from_json_text(
            '{"UserConfig":{"Namespaces":[{"Name":"n","Queues":[{"Name":"q","Properties":{"LockDurationX":"PT1M"}}]}]}}'
        )
    with pytest.raises(ConfigError, match="forwards to 'nowhere'"):
        EmulatorConfig.from_json_text(
            '{"UserConfig":{"Namespaces":[{"Name":"n","Queues":[{"Name":"q","Properties":{"ForwardTo":"nowhere"}}]}]}}'
        )


def test_entity_paths_strip_host_and_recognise_sub_queues():
    assert EntityPath.parse("amqps://h:1/Orders/$DeadLetterQueue") == EntityPath("Orders", True)
    assert EntityPath.parse("orders/$management") == EntityPath("orders", False, True)
    assert EntityPath.parse("q/$Transfer/$DeadLetterQueue").dead_letter


def test_lock_expiry_increments_delivery_count_and_redelivers():
    # Given a locked message with a 10 s lock
    q = Queue("q", QueueProperties.of(lock_duration=10))
    q.enqueue(msg(), now=0)
    first = q.lock_next(None, now=0)
    assert first is not None and q.lock_next(None, now=1) is None
    # When time passes the lock; Then it is ready again with delivery count 1, and the old token is dead
    q.tick(10.0)
    again = q.lock_next(None, now=10.0)
    assert again is not None and again.message.delivery_count == 1
    with pytest.raises(MessageLockLostError):
        q.complete(first.lock_token, now=10.0)  # type: ignore[arg-type]


def test_release_does_not_count_a_delivery_but_abandon_does():
    q = Queue("q", QueueProperties())
    q.enqueue(msg(), now=0)
    d = q.lock_next(None, 0)
    q.release(d.lock_token, 0)  # type: ignore[union-attr, arg-type]
    d = q.lock_next(None, 0)
    assert d is not None and d.message.delivery_count == 0
    q.abandon(d.lock_token, 0)  # type: ignore[arg-type]
    assert q.lock_next(None, 0).message.delivery_count == 1  # type: ignore[union-attr]


def test_max_delivery_count_dead_letters_through_the_broker():
    broker = Broker(EmulatorConfig.with_queues("q", max_delivery_count=1), clock=lambda: 0.0)
    broker.send("q", [msg()], 1)
    d = broker.queue("q").lock_next(None, 0)
    broker.queue("q").abandon(d.lock_token, 0)  # type: ignore[union-attr, arg-type]
    (dead,) = broker.queue("q/$DeadLetterQueue").messages.values()
    assert dead.dead_letter_reason == "MaxDeliveryCountExceeded"


def test_ttl_expiry_dead_letters_when_configured_and_never_in_the_dlq():
    broker = Broker(
        EmulatorConfig.with_queues("q", default_message_time_to_live=5, dead_lettering_on_message_expiration=True)
    )
    q = broker.queue("q")
    q.enqueue(msg(ttl=1), now=0)
    q.tick(2)
    dlq = broker.queue("q/$deadletterqueue")
    assert len(q.messages) == 0 and len(dlq.messages) == 1
    dlq.tick(10_000)
    assert len(dlq.messages) == 1


def test_duplicates_dropped_within_window_and_accepted_after_it():
    q = Queue("q", QueueProperties.of(requires_duplicate_detection=True, duplicate_detection_history_time_window=60))
    assert q.enqueue(msg(message_id="a"), now=0) == 1
    assert q.enqueue(msg(message_id="a"), now=30) is None
    assert q.enqueue(msg(message_id="a"), now=61) == 2


def test_size_and_quota_limits():
    q = Queue("q", QueueProperties.of(max_message_size=1024, max_size_bytes=2048))
    with pytest.raises(MessageSizeExceededError):
        q.check_size(2000)
    q.enqueue(msg(b"a" * 1000), 0)
    q.enqueue(msg(b"a" * 1000), 0)
    with pytest.raises(QuotaExceededError):
        q.enqueue(msg(b"a" * 100), 0)


def test_unknown_entity_is_not_found():
    with pytest.raises(EntityNotFoundError):
        Broker(EmulatorConfig()).queue("nope")


def test_scheduled_message_is_invisible_until_due_and_deferred_only_by_sequence():
    q = Queue("q", QueueProperties())
    seq = q.enqueue(msg(scheduled_enqueue_time=100), now=0)
    assert q.messages[seq].state is MessageState.SCHEDULED  # type: ignore[index]
    assert q.lock_next(None, 50) is None
    q.tick(100)
    d = q.lock_next(None, 100)
    assert d is not None
    q.defer(d.lock_token, 100)  # type: ignore[arg-type]
    assert q.lock_next(None, 100) is None
    (again,) = q.lock_deferred([seq], 100)  # type: ignore[list-item]
    q.complete(again.lock_token, 100)  # type: ignore[arg-type]
    assert not q.messages


def test_session_lock_is_exclusive_and_expires():
    q = Queue("q", QueueProperties.of(requires_session=True, lock_duration=10))
    q.enqueue(msg(session_id="s"), 0)
    a, b = object(), object()
    assert q.sessions.lock(None, a, 0).session_id == "s"  # type: ignore[union-attr]
    with pytest.raises(SessionCannotBeLockedError):
        q.sessions.lock("s", b, 1)
    q.tick(10)
    assert q.sessions.lost == [("s", a)]
    assert q.sessions.lock("s", b, 10) is not None

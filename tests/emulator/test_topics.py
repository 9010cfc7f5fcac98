"""Topics and subscriptions through the unmodified SDK: fan-out, filters, DLQs, management."""

from __future__ import annotations

import datetime as dt
import uuid
from pathlib import Path

import pytest
from azure.servicebus import ServiceBusClient, ServiceBusMessage, ServiceBusReceivedMessage, ServiceBusSubQueue
from azure.servicebus.exceptions import ServiceBusError

from sbemulator import Emulator, EmulatorConfig
from sbemulator.testing import running_emulator, unique_topic, wait_until

pytestmark = pytest.mark.integration
MS = dt.timedelta(milliseconds=1)  # times travel as whole milliseconds


def _receive(
    client: ServiceBusClient, topic: str, sub: str, n: int, *, complete: bool = True, sub_queue: str | None = None
) -> list[ServiceBusReceivedMessage]:
    out: list[ServiceBusReceivedMessage] = []
    with client.get_subscription_receiver(topic, sub, max_wait_time=1, sub_queue=sub_queue) as receiver:
        for _ in range(10):
            if len(out) >= n:
                break
            for m in receiver.receive_messages(n - len(out), max_wait_time=2):
                if complete:
                    receiver.complete_message(m)
                out.append(m)
    return out


def _send(client: ServiceBusClient, topic: str, *messages: ServiceBusMessage) -> None:
    with client.get_topic_sender(topic) as sender:
        sender.send_messages(list(messages))


def test_every_subscription_gets_its_own_copy_and_settles_it_alone(client: ServiceBusClient, emulator: Emulator):
    # Given a topic with two subscriptions without rules
    topic = unique_topic(emulator, "search", "audit")
    # When one message is sent to the topic
    _send(client, topic, ServiceBusMessage("hello", message_id="m1", application_properties={"k": "v"}))
    # Then each subscription receives it; abandoning it in one leaves the other's copy alone
    with client.get_subscription_receiver(topic, "search", max_wait_time=5) as receiver:
        (first,) = receiver.receive_messages(1, max_wait_time=5)
        receiver.abandon_message(first)
    (audit,) = _receive(client, topic, "audit", 1)
    assert str(audit) == "hello" and audit.message_id == "m1" and audit.delivery_count == 0
    (again,) = _receive(client, topic, "search", 1)
    assert again.delivery_count == 1
    assert emulator.queue_stats(f"{topic}/Subscriptions/search")["messages"] == 0
    assert emulator.queue_stats(f"{topic}/Subscriptions/audit")["messages"] == 0


SQL = "sys.Label = 'order' AND color IN ('red', 'blue') AND NOT region <> 'eu'"


def test_correlation_and_sql_rules_route_messages(client: ServiceBusClient, emulator: Emulator):
    # Given subscriptions filtering on subject, application properties and SQL expressions
    topic = unique_topic(
        emulator,
        {"Name": "orders", "Rules": [{"Name": "r", "Properties": {"FilterType": "Correlation",
            "CorrelationFilter": {"Label": "order", "Properties": {"region": "eu"}}}}]},
        {"Name": "sql", "Rules": [{"Name": "r", "Properties": {"FilterType": "Sql",
            "SqlFilter": {"SqlExpression": SQL}}}]},
        {"Name": "either", "Rules": [
            {"Name": "a", "Properties": {"SqlFilter": {"SqlExpression": "qty > 10 OR sys.label = 'x'"}}},
            {"Name": "b", "Properties": {"FilterType": "Correlation", "CorrelationFilter": {"CorrelationId": "c-9"}}}]},
        "all",
    )  # fmt: skip
    # When messages with different properties are sent
    _send(
        client,
        topic,
        ServiceBusMessage("1", subject="order", application_properties={"region": "eu", "color": "red"}),
        ServiceBusMessage("2", subject="order", application_properties={"region": "us", "color": "red", "qty": 11}),
        ServiceBusMessage("3", subject="x", correlation_id="c-9"),  # matches both rules of "either": one copy
        ServiceBusMessage("4", subject="order", application_properties={"region": "eu", "color": "green"}),
    )
    # Then each subscription holds exactly the messages its rules match
    got = {sub: sorted(str(m) for m in _receive(client, topic, sub, n)) for sub, n in
           (("orders", 2), ("sql", 1), ("either", 2), ("all", 4))}  # fmt: skip
    assert got == {"orders": ["1", "4"], "sql": ["1"], "either": ["2", "3"], "all": ["1", "2", "3", "4"]}
    for sub in got:
        assert emulator.queue_stats(f"{topic}/Subscriptions/{sub}")["messages"] == 0


def test_each_subscription_dead_letters_on_its_own_max_delivery_count(client: ServiceBusClient, emulator: Emulator):
    # Given a subscription with MaxDeliveryCount 1 and another with the default
    topic = unique_topic(emulator, {"Name": "fragile", "Properties": {"MaxDeliveryCount": 1}}, "sturdy")
    _send(client, topic, ServiceBusMessage("poison", message_id="p1"))
    # When the fragile one abandons it once, and the sturdy one dead-letters nothing
    with client.get_subscription_receiver(topic, "fragile", max_wait_time=5) as receiver:
        (m,) = receiver.receive_messages(1, max_wait_time=5)
        receiver.abandon_message(m)
    # Then it is in fragile's dead-letter queue only, received with sub_queue=DEAD_LETTER
    (dead,) = _receive(client, topic, "fragile", 1, sub_queue=ServiceBusSubQueue.DEAD_LETTER)
    assert dead.message_id == "p1" and dead.dead_letter_reason == "MaxDeliveryCountExceeded"
    assert emulator.queue_stats(f"{topic}/Subscriptions/sturdy") == {
        "messages": 1, "active": 1, "deferred": 0, "scheduled": 0, "locked": 0, "dead_lettered": 0, "bytes": 0,
    } | {"bytes": emulator.queue_stats(f"{topic}/Subscriptions/sturdy")["bytes"]}  # fmt: skip
    # And an explicit dead-letter lands in that subscription's DLQ with its reason
    with client.get_subscription_receiver(topic, "sturdy", max_wait_time=5) as receiver:
        (m,) = receiver.receive_messages(1, max_wait_time=5)
        receiver.dead_letter_message(m, reason="bad", error_description="handler failed")
    (dead,) = _receive(client, topic, "sturdy", 1, sub_queue=ServiceBusSubQueue.DEAD_LETTER)
    assert (dead.dead_letter_reason, dead.dead_letter_error_description) == ("bad", "handler failed")


def test_duplicate_detection_on_the_topic_drops_a_resend(client: ServiceBusClient, emulator: Emulator):
    topic = unique_topic(emulator, "a", "b", RequiresDuplicateDetection=True)
    _send(client, topic, ServiceBusMessage("one", message_id="same"))
    _send(client, topic, ServiceBusMessage("again", message_id="same"), ServiceBusMessage("two", message_id="other"))
    for sub in ("a", "b"):
        assert sorted(str(m) for m in _receive(client, topic, sub, 2)) == ["one", "two"]


def test_management_operations_on_subscriptions_and_topic_scheduling(client: ServiceBusClient, emulator: Emulator):
    topic = unique_topic(emulator, {"Name": "s", "Properties": {"LockDuration": "PT5S"}}, "t")
    # Scheduling on the topic sender reaches every subscription; cancelling takes it back everywhere
    due = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=2)
    with client.get_topic_sender(topic) as sender:
        (cancelled,) = sender.schedule_messages(ServiceBusMessage("never"), due + dt.timedelta(hours=1))
        sender.schedule_messages(ServiceBusMessage("later"), due)
        sender.cancel_scheduled_messages(cancelled)
    assert emulator.queue_stats(f"{topic}/Subscriptions/t")["scheduled"] == 1
    (later,) = _receive(client, topic, "t", 1)
    assert str(later) == "later" and later.enqueued_time_utc is not None and later.enqueued_time_utc >= due - MS
    # Peek and renew-lock on a subscription receiver
    with client.get_subscription_receiver(topic, "s", max_wait_time=5) as receiver:
        (peeked,) = receiver.peek_messages(5)
        assert str(peeked) == "later"
        (m,) = receiver.receive_messages(1, max_wait_time=5)
        before = m.locked_until_utc
        assert before is not None
        wait_until(lambda: receiver.renew_message_lock(m) > before, timeout=10)
        receiver.complete_message(m)


def test_sessions_on_a_subscription(client: ServiceBusClient, emulator: Emulator):
    topic = unique_topic(emulator, {"Name": "s", "Properties": {"RequiresSession": True}})
    _send(client, topic, *(ServiceBusMessage(f"{sid}-{i}", session_id=sid) for sid in ("x", "y") for i in range(2)))
    with client.get_subscription_receiver(topic, "s", session_id="y", max_wait_time=2) as receiver:
        got = receiver.receive_messages(5, max_wait_time=3)
        for m in got:
            receiver.complete_message(m)
    assert [str(m) for m in got] == ["y-0", "y-1"]


def test_topics_refuse_receivers_and_subscriptions_refuse_senders(client: ServiceBusClient, emulator: Emulator):
    topic = unique_topic(emulator, "s")
    with pytest.raises(ServiceBusError, match="is a topic"), client.get_queue_receiver(topic) as receiver:
        receiver.receive_messages(1, max_wait_time=1)
    with pytest.raises(ServiceBusError), client.get_queue_sender(f"{topic}/Subscriptions/s") as sender:
        sender.send_messages(ServiceBusMessage("x"))
    with pytest.raises(ServiceBusError), client.get_subscription_receiver(topic, "nope") as receiver:
        receiver.receive_messages(1, max_wait_time=1)


def test_forward_to_from_a_subscription_to_a_queue(client: ServiceBusClient, emulator: Emulator):
    queue = f"fwd-{uuid.uuid4().hex[:8]}"
    emulator.create_queue(queue)
    topic = unique_topic(emulator, {"Name": "s", "Properties": {"ForwardTo": queue}})
    _send(client, topic, ServiceBusMessage("via topic"))
    with client.get_queue_receiver(queue, max_wait_time=5) as receiver:
        (m,) = receiver.receive_messages(1, max_wait_time=5)
        receiver.complete_message(m)
    assert str(m) == "via topic"


CONFIG = """{"UserConfig": {"Namespaces": [{"Name": "sbemulatorns", "Queues": [],
  "Topics": [{"Name": "topic.1", "Properties": {"RequiresDuplicateDetection": true},
    "Subscriptions": [{"Name": "subscription.1", "Properties": {"MaxDeliveryCount": 3},
      "Rules": [{"Name": "r", "Properties": {"FilterType": "Correlation",
        "CorrelationFilter": {"Properties": {"prop3": "value3"}}}}]}]}]}]}}"""


def test_subscriptions_from_config_json_persist_across_a_restart(tmp_path: Path):
    config = EmulatorConfig.from_json_text(CONFIG)
    # Given a message in a Config.json subscription and one in a topic created at runtime
    with running_emulator(config, data_dir=tmp_path) as emu:
        runtime = unique_topic(emu, "s")
        with ServiceBusClient.from_connection_string(emu.connection_string, retry_total=0) as sb:
            _send(sb, "topic.1", ServiceBusMessage("kept", application_properties={"prop3": "value3"}))
            _send(sb, "topic.1", ServiceBusMessage("filtered out"))
            _send(sb, runtime, ServiceBusMessage("runtime"))
    # When the emulator restarts on the same data dir, Then both are still there
    with (
        running_emulator(config, data_dir=tmp_path) as emu,
        ServiceBusClient.from_connection_string(emu.connection_string, retry_total=0) as sb,
    ):
        assert [str(m) for m in _receive(sb, "topic.1", "subscription.1", 1)] == ["kept"]
        assert [str(m) for m in _receive(sb, runtime, "s", 1)] == ["runtime"]

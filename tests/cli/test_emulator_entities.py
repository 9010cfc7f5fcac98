"""The emulator entities of an app: its queues, its topics and one rule-filtered subscription each."""

from __future__ import annotations

import signal
import subprocess
import sys
import tomllib
from pathlib import Path

from azure.servicebus import ServiceBusClient, ServiceBusMessage

from dbfanout.ops.entities import emulator_config_for
from sbemulator import Emulator
from sbemulator.testing import running_emulator
from shared.config import parse_config
from shared.topology import PROP_TARGET, RULE_NAME, subscription_rule

APP = """
[app]
name = "shop"

[pollers.orders]
source_url = "${ORDERS_DB_URL}"
table = "orders"
cursor = "updated_at"
pk = ["id"]
topic = "order-events"
sessions = true
max_delivery_count = 7

[pollers.orders.subscriptions.search]
handler = "handlers.search:handle"

[pollers.orders.subscriptions.audit]
handler = "handlers.audit:handle"
filter = "[dbfanout-event-count] > 1"
max_delivery_count = 3

[pollers.customers]
source_url = "${ORDERS_DB_URL}"
table = "customers"
cursor = "updated_at"
pk = ["id"]
queue = "customer-changes"
max_delivery_count = 5

[pollers.light]
source_url = "${ORDERS_DB_URL}"
table = "customers"
cursor = "updated_at"
pk = ["id"]
queue = "light-changes"
transport = "storage-queue"
"""


def test_the_app_declares_its_queues_and_topics_with_each_subscriptions_rule() -> None:
    # Given an app with a session topic poller, a queue poller and a storage-queue poller
    config = parse_config(tomllib.loads(APP), {"ORDERS_DB_URL": "sqlite://"})
    # When its emulator entities are declared
    declared = emulator_config_for(config, lock_duration="PT30S")
    # Then the Service Bus queue has duplicate detection and the poller's MaxDeliveryCount (no storage queue)
    (queue,) = declared.queues
    assert queue.name == "customer-changes"
    props = queue.properties
    assert (props.requires_duplicate_detection, props.max_delivery_count, props.lock_duration) == (True, 5, 30.0)
    assert not props.requires_session
    # And the topic has duplicate detection and one subscription per configured one
    (topic,) = declared.topics
    assert topic.name == "order-events" and topic.properties.requires_duplicate_detection
    subs = {s.name: s for s in topic.subscriptions}
    assert set(subs) == {"search", "audit"}
    # each with its MaxDeliveryCount (its own, else the poller's), sessions, and the one $Default rule
    assert {n: s.properties.max_delivery_count for n, s in subs.items()} == {"search": 7, "audit": 3}
    assert all(s.properties.requires_session and s.properties.lock_duration == 30.0 for s in subs.values())
    for name, sub in subs.items():
        (rule,) = sub.rules
        assert rule.name == RULE_NAME
        expected = subscription_rule(config.poller("orders").subscription(name))
        assert getattr(rule.matches, "expression", None) == expected


def test_the_rules_route_untargeted_copies_to_all_and_targeted_ones_to_one() -> None:
    # Given the declared topic (without sessions) on a real emulator
    text = APP.replace("sessions = true\n", "")
    declared = emulator_config_for(parse_config(tomllib.loads(text), {"ORDERS_DB_URL": "sqlite://"}))
    with (
        running_emulator(declared) as emulator,
        ServiceBusClient.from_connection_string(emulator.connection_string) as client,
        client.get_topic_sender("order-events") as sender,
    ):
        # When a batch of one event, a batch of two, and a single addressed to each subscription are sent
        sender.send_messages(
            [
                _message("one", 1),
                _message("two", 2),
                _message("to-search", 1, "search"),
                _message("to-audit", 1, "audit"),
            ]
        )
        # Then search gets the untargeted ones and its own; audit what its filter accepts, and its own
        # single even though the filter would refuse it (a split or a replay is not filtered again)
        assert _bodies(emulator, client, "search", 3) == ["one", "to-search", "two"]
        assert _bodies(emulator, client, "audit", 2) == ["to-audit", "two"]


def _message(body: str, events: int, target: str | None = None) -> ServiceBusMessage:
    props: dict[str | bytes, object] = {"dbfanout-event-count": events}
    if target is not None:
        props[PROP_TARGET] = target
    return ServiceBusMessage(body, application_properties=props)  # type: ignore[arg-type]


def _bodies(emulator: Emulator, client: ServiceBusClient, subscription: str, n: int) -> list[str]:
    with client.get_subscription_receiver("order-events", subscription, max_wait_time=2) as receiver:
        got = receiver.receive_messages(max_message_count=10, max_wait_time=2)
        while len(got) < n and (more := receiver.receive_messages(max_message_count=10, max_wait_time=2)):
            got += more
        for m in got:
            receiver.complete_message(m)
    assert emulator.queue_stats(f"order-events/Subscriptions/{subscription}")["messages"] == 0
    return sorted(str(m) for m in got)


def test_emulator_servicebus_app_config_declares_the_apps_entities(tmp_path: Path) -> None:
    # Given a dbfanout.toml whose source_url setting is not set (the emulator never needs it)
    path = tmp_path / "dbfanout.toml"
    path.write_text(APP)
    # When the emulator is started with --app-config
    cmd = [sys.executable, "-m", "dbfanout.cli", "emulator", "servicebus", "--port", "0", "--http-port", "0"]
    proc = subprocess.Popen(
        [*cmd, "--app-config", str(path)], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        assert proc.stdout is not None
        lines: list[str] = []
        while not any(line.startswith("Topics:") for line in lines) and len(lines) < 20:  # the last line it prints
            lines.append(proc.stdout.readline())
        # Then it serves the app's Service Bus queue and its topic with both subscriptions
        assert "Queues: customer-changes\n" in lines, lines
        assert "Topics: order-events [search, audit]\n" in lines, lines
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)

"""``dbfanout run`` with a topic poller: one change stream, two subscriptions, each on its own.

SQLite source → poller timer → emulator topic (duplicate detection; the entities and each
subscription's ``$Default`` rule from :func:`dbfanout.ops.entities.emulator_config_for`) → one
subscription trigger per subscription → its handler. ``search`` records every event it is given;
``audit`` fails on one poison row. The poison batch is retried and split inside ``audit`` only:
``search`` sees every event exactly once, ``audit`` handles every good row, and ``audit``'s
dead-letter queue holds the poison event alone.
"""

from __future__ import annotations

import json
import shutil
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from azure.servicebus import ServiceBusClient, ServiceBusReceivedMessage, ServiceBusSubQueue

from dbfanout.host.app_loader import FunctionSpec
from dbfanout.host.servicebus import ServiceBusTrigger
from dbfanout.ops.entities import emulator_config_for
from sbemulator import Emulator
from shared.codec import decode_batch
from shared.config import load_config
from shared.errors import ConfigError
from shared.ids import subscription_split_message_id
from shared.topology import PROP_TARGET
from tests.host.app_support import SOURCE_DDL, AppDir, HostProcess, sqlite_engine, wait_for
from tests.support.azurite import Azurite

pytestmark = pytest.mark.integration

ROWS = 60
POISON = 23
PROBE = Path(__file__).with_name("topic_probe.py")


SUBSCRIPTIONS: dict[str, dict[str, str | int]] = {
    "search": {"handler": "topic_probe:record", "cardinality": "many"},
    "audit": {"handler": "topic_probe:record_unless_poisoned", "max_delivery_count": 4},
}


def _topic_app(
    tmp_path: Path,
    azurite: Azurite,
    servicebus: Emulator,
    *,
    sessions: bool = False,
    subscriptions: dict[str, dict[str, str | int]] = SUBSCRIPTIONS,
) -> AppDir:
    """An app folder whose poller sends to a fresh topic with ``subscriptions`` (search and audit)."""
    topic = f"orders-{uuid.uuid4().hex[:10]}"
    app = AppDir.create(
        tmp_path / "app",
        queue=topic,
        storage=azurite.connection_string,
        servicebus=servicebus.connection_string,
        batch_size=20,
        poller_toml=f"sessions = {'true' if sessions else 'false'}",
        subscriptions=subscriptions,
    )
    shutil.copy(PROBE, app.root / "topic_probe.py")
    (app.root / "poison-id").write_text(str(POISON))
    engine = sqlite_engine(app.root / "source.db")
    with engine.begin() as conn:
        conn.exec_driver_sql(SOURCE_DDL)
        conn.execute(
            sa.text("INSERT INTO orders (id, version, v) VALUES (:i, :i, :v)"),
            [{"i": i, "v": f"row {i}"} for i in range(1, ROWS + 1)],
        )
    engine.dispose()
    # The entities come from the app's own config, as `dbfanout emulator servicebus --app-config` does
    config = load_config(app.root / "dbfanout.toml", settings=app.settings)
    (declared,) = emulator_config_for(config, lock_duration="PT30S").topics
    servicebus.create_topic(declared)
    return app


def _seen(app: AppDir, subscription: str) -> list[dict[str, Any]]:
    path = app.root / f"seen-{subscription}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _stats(servicebus: Emulator, app: AppDir, subscription: str) -> dict[str, int]:
    return servicebus.queue_stats(f"{app.queue}/Subscriptions/{subscription}")


def _dead_letters(servicebus: Emulator, app: AppDir, subscription: str) -> list[ServiceBusReceivedMessage]:
    with (
        ServiceBusClient.from_connection_string(servicebus.connection_string) as client,
        client.get_subscription_receiver(
            app.queue, subscription, sub_queue=ServiceBusSubQueue.DEAD_LETTER, max_wait_time=2
        ) as receiver,
    ):
        return list(receiver.peek_messages(max_message_count=10))


@pytest.mark.parametrize("sessions", [False, True], ids=["batches", "sessions"])
def test_a_poisoned_subscription_splits_and_dead_letters_alone_while_the_other_sees_each_event_once(
    tmp_path: Path, azurite: Azurite, servicebus: Emulator, sessions: bool
) -> None:
    # Given a topic poller over 60 rows with subscriptions search (records) and audit (row 23 is poison)
    app = _topic_app(tmp_path, azurite, servicebus, sessions=sessions)
    host = HostProcess(app).start()
    try:
        # When `dbfanout run` polls and serves both subscriptions until audit dead-letters the poison
        wait_for(lambda: _stats(servicebus, app, "audit")["dead_lettered"] == 1, 120, "audit's poison to dead-letter")
        wait_for(lambda: len({s["id"] for s in _seen(app, "audit")}) == ROWS - 1, 60, "audit's good rows")
        wait_for(lambda: len(_seen(app, "search")) >= ROWS, 60, "search to see every row")
        drained = lambda: all(_stats(servicebus, app, sub)["messages"] == 0 for sub in ("search", "audit"))  # noqa: E731
        wait_for(drained, 60, "both subscriptions to drain")
        assert host.terminate() == 0, host.log_tail()
    finally:
        host.stop_quietly()
    search, audit = _seen(app, "search"), _seen(app, "audit")
    # Then search saw every event exactly once, untouched by audit's retries and split
    assert Counter(s["id"] for s in search) == Counter(range(1, ROWS + 1))
    assert len({s["event_id"] for s in search}) == ROWS
    assert {(s["subscription"], s["target"]) for s in search} == {("search", None)}
    assert _stats(servicebus, app, "search")["dead_lettered"] == 0
    # And audit handled every good row, and nothing but in its own subscription
    assert {s["id"] for s in audit} == set(range(1, ROWS + 1)) - {POISON}
    assert {s["subscription"] for s in audit} == {"audit"}
    # And audit's dead-letter queue holds the poison event alone
    (dead,) = _dead_letters(servicebus, app, "audit")
    (event,) = decode_batch(b"".join(dead.body)).events
    assert event.pk == {"id": POISON}
    props = {(k.decode() if isinstance(k, bytes) else k): v for k, v in (dead.application_properties or {}).items()}
    if sessions:
        # one event per message already (one session per key): nothing to split, the original waits
        assert dead.session_id == f"id={POISON}" and PROP_TARGET not in props
    else:
        # split inside audit: the single went to the topic addressed to audit only
        assert dead.message_id == subscription_split_message_id(event.event_id, "audit")
        target = props[PROP_TARGET]
        assert (target.decode() if isinstance(target, bytes) else target) == "audit"
        assert any(s["target"] == "audit" for s in audit)  # its good singles were handled too


def test_two_subscriptions_splitting_the_same_batch_each_get_their_own_singles(
    tmp_path: Path, azurite: Azurite, servicebus: Emulator
) -> None:
    # Given both subscriptions fail on the same poison row, so both split the same parent message
    poisoned: dict[str, str | int] = {"handler": "topic_probe:record_unless_poisoned", "max_delivery_count": 4}
    app = _topic_app(tmp_path, azurite, servicebus, subscriptions={"search": poisoned, "audit": poisoned})
    host = HostProcess(app).start()
    try:
        # When both have dead-lettered the poison single
        both = ("search", "audit")
        dead = lambda: all(_stats(servicebus, app, sub)["dead_lettered"] == 1 for sub in both)  # noqa: E731
        wait_for(dead, 120, "each subscription's poison to dead-letter")
        # Then each handled every good row: the topic's duplicate detection dropped neither one's singles
        good = set(range(1, ROWS + 1)) - {POISON}
        wait_for(lambda: all({s["id"] for s in _seen(app, sub)} == good for sub in both), 60, "every good row twice")
        assert host.terminate() == 0, host.log_tail()
    finally:
        host.stop_quietly()
    # And each dead-letter queue holds the poison single addressed to that subscription
    for sub in both:
        (message,) = _dead_letters(servicebus, app, sub)
        (event,) = decode_batch(b"".join(message.body)).events
        assert event.pk == {"id": POISON}
        assert message.message_id == subscription_split_message_id(event.event_id, sub)


def test_a_subscription_binding_is_received_from_the_topics_subscription() -> None:
    # Given a serviceBusTrigger binding naming a topic (through a %SETTING%) and a subscription
    settings = {"SB": "Endpoint=sb://127.0.0.1:1;SharedAccessKeyName=k;SharedAccessKey=v", "TOPIC": "orders"}
    binding = {"type": "serviceBusTrigger", "name": "msg", "connection": "SB", "topicName": "%TOPIC%"}
    spec = FunctionSpec("work_orders_audit", {**binding, "subscriptionName": "audit"}, lambda msg: None)
    # Then the local host receives from orders/Subscriptions/audit
    trigger = ServiceBusTrigger.of(spec, settings)
    assert (trigger.topic, trigger.subscription, trigger.queue) == ("orders", "audit", "orders/Subscriptions/audit")
    # And a binding with a topic but no subscription is refused, naming what is missing
    with pytest.raises(ConfigError) as raised:
        ServiceBusTrigger.of(FunctionSpec("work_orders", binding, lambda msg: None), settings)
    assert raised.value.key == "work_orders.subscriptionName"

"""An operator's workspace for CLI tests: a dbfanout.toml, settings in the environment, real servers.

Each test gets its own app name, state container, SQLite source and emulator queue, so tests
share the session's Azurite and emulator without seeing each other's state. ``topic_workspace``
is the same with a topic poller: a topic with the subscriptions ``search`` and ``audit``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from azure.servicebus import ServiceBusClient, ServiceBusMessage
from typer.testing import CliRunner, Result

from dbfanout.cli import app
from dbfanout.commands.common import load
from dbfanout.ops.entities import emulator_config_for
from poller.sinks.servicebus import ServiceBusSink
from poller.sources.factory import open_source
from poller.state.blob import BlobStateStore, open_state_store
from poller.tick.lifecycle import TickResult, run_tick
from sbemulator import Emulator
from sbemulator.testing import unique_queue
from shared.config import Config
from shared.servicebus import QueueSender
from shared.settings import StorageConnection
from tests.poller.tick_support import RecordingSink, SourceTable
from tests.support.azurite import Azurite
from worker.consumer import settle_received
from worker.runtime import Worker

TOML = """
[app]
name = "{app}"
state_container = "{container}"

[pollers.orders]
source_url = "${{ORDERS_DB_URL}}"
table = "orders"
cursor = "version"
pk = ["id"]
queue = "{queue}"
batch_size = 10
max_batches_per_tick = 100
lease_ttl_seconds = 30
settle_seconds = 0
soft_delete_column = "deleted_at"
"""

BACKFILL = """
[pollers.orders_backfill]
source_url = "${{ORDERS_DB_URL}}"
table = "orders"
cursor = "version"
pk = ["id"]
queue = "{queue}"
batch_size = 10
lease_ttl_seconds = 30
settle_seconds = 0
soft_delete_column = "deleted_at"
"""


TOPIC_TOML = """
[app]
name = "{app}"
state_container = "{container}"

[pollers.orders]
source_url = "${{ORDERS_DB_URL}}"
table = "orders"
cursor = "version"
pk = ["id"]
topic = "{topic}"
batch_size = 10
lease_ttl_seconds = 30
settle_seconds = 0
max_delivery_count = 3

[pollers.orders.subscriptions.search]
handler = "topic_handlers:search"

[pollers.orders.subscriptions.audit]
handler = "topic_handlers:audit"
"""

TOPIC_HANDLERS = """
def search(events, context):
    pass


def audit(events, context):
    pass
"""


@dataclass
class Workspace:
    """A tmp dir with dbfanout.toml, the env settings it needs, and helpers to drive the CLI."""

    root: Path
    config_path: Path
    app_name: str
    container: str
    queue: str
    source: SourceTable
    azurite: Azurite
    emulator: Emulator

    @property
    def config(self) -> Config:
        return load(self.config_path)

    def run(self, *args: str, input: str | None = None) -> Result:
        """``dbfanout ARGS --config dbfanout.toml`` in-process (stdin is not a terminal)."""
        return CliRunner(env={"COLUMNS": "250"}).invoke(app, [*args, "--config", str(self.config_path)], input=input)

    def store(self, poller: str = "orders") -> BlobStateStore:
        conn = StorageConnection(connection_string=self.azurite.connection_string)
        return open_state_store(conn, self.container, self.app_name, poller)

    def tick(self, poller: str = "orders", sink: Any = None, owner_id: str = "poller-1") -> TickResult:
        cfg = self.config.poller(poller)
        return run_tick(cfg, open_source(cfg), self.store(poller), sink or RecordingSink(), owner_id=owner_id)

    def drain(self, poller: str = "orders") -> RecordingSink:
        """Tick until caught up with a recording sink; returns what it accepted."""
        sink = RecordingSink()
        for _ in range(50):
            if self.tick(poller, sink).stop_reason == "caught_up":
                return sink
        raise AssertionError("the poller did not catch up")

    def bus_sink(self, client: ServiceBusClient, poller: str = "orders") -> ServiceBusSink:
        cfg = self.config.poller(poller)
        return ServiceBusSink(cfg, QueueSender(client, cfg.queue))

    def add_backfill(self) -> None:
        self.config_path.write_text(self.config_path.read_text() + BACKFILL.format(queue=self.queue))


@pytest.fixture
def workspace(tmp_path: Path, azurite: Azurite, servicebus: Emulator, monkeypatch: pytest.MonkeyPatch) -> Workspace:
    app_name = f"app{uuid.uuid4().hex[:8]}"
    container = f"state-{uuid.uuid4().hex[:10]}"
    queue = unique_queue(servicebus, "orders", requires_duplicate_detection=True, lock_duration=5, max_delivery_count=3)
    source = SourceTable(f"sqlite:///{tmp_path / 'source.db'}")
    config_path = tmp_path / "dbfanout.toml"
    config_path.write_text(TOML.format(app=app_name, container=container, queue=queue))
    monkeypatch.setenv("ORDERS_DB_URL", str(source.engine.url))
    monkeypatch.setenv("DBFANOUT_STATE", azurite.connection_string)
    monkeypatch.setenv("DBFANOUT_SERVICEBUS", servicebus.connection_string)
    monkeypatch.chdir(tmp_path)
    return Workspace(tmp_path, config_path, app_name, container, queue, source, azurite, servicebus)


def declare_topic(emulator: Emulator, config: Config, poller: str = "orders", **changes: dict[str, Any]) -> None:
    """Create the poller's topic in the emulator as ``dbfanout emulator servicebus --app-config``
    declares it (:func:`dbfanout.ops.entities.emulator_config_for`: duplicate detection on, each
    configured subscription with its MaxDeliveryCount and the ``$Default`` rule of
    :func:`shared.topology.subscription_rule`), with a 5 s lock.

    ``changes`` per subscription name: Config.json keys that replace the made ones
    (``{"Properties": {...}}``, ``{"Rules": [...]}``); ``{"omit": True}`` leaves a configured
    subscription out; ``{"extra": True}`` adds one the config does not name."""
    topic = config.poller(poller).queue
    (declared,) = (t.raw for t in emulator_config_for(config, lock_duration="PT5S").topics if t.name == topic)
    subs: list[dict[str, Any]] = []
    for sub in sorted(declared["Subscriptions"], key=lambda s: str(s["Name"])):
        change = dict(changes.get(sub["Name"], {}))
        if change.pop("omit", False):
            continue
        subs.append(dict(sub) | change)
    subs.extend({"Name": name} for name, change in changes.items() if change.get("extra"))
    emulator.create_topic({**declared, "Subscriptions": subs})


def topic_workspace_of(
    tmp_path: Path, azurite: Azurite, servicebus: Emulator, monkeypatch: pytest.MonkeyPatch, **changes: Any
) -> Workspace:
    """A workspace whose poller ``orders`` sends to a fresh topic (``workspace.queue`` is the topic)."""
    app_name = f"app{uuid.uuid4().hex[:8]}"
    container = f"state-{uuid.uuid4().hex[:10]}"
    topic = f"orders-{uuid.uuid4().hex[:10]}"
    source = SourceTable(f"sqlite:///{tmp_path / 'source.db'}")
    config_path = tmp_path / "dbfanout.toml"
    config_path.write_text(TOPIC_TOML.format(app=app_name, container=container, topic=topic))
    (tmp_path / "topic_handlers.py").write_text(TOPIC_HANDLERS)
    monkeypatch.setenv("ORDERS_DB_URL", str(source.engine.url))
    monkeypatch.setenv("DBFANOUT_STATE", azurite.connection_string)
    monkeypatch.setenv("DBFANOUT_SERVICEBUS", servicebus.connection_string)
    monkeypatch.chdir(tmp_path)
    workspace = Workspace(tmp_path, config_path, app_name, container, topic, source, azurite, servicebus)
    declare_topic(servicebus, workspace.config, **changes)
    return workspace


@pytest.fixture
def topic_workspace(
    tmp_path: Path, azurite: Azurite, servicebus: Emulator, monkeypatch: pytest.MonkeyPatch
) -> Workspace:
    return topic_workspace_of(tmp_path, azurite, servicebus, monkeypatch)


def dead_letter_in_subscription(
    client: ServiceBusClient,
    topic: str,
    subscription: str,
    bodies: Sequence[bytes],
    *,
    others: Sequence[str] = ("audit",),
    reason: str = "HandlerFailed",
) -> list[str]:
    """Send to the topic, dead-letter every copy in ``subscription``, complete them in ``others``
    (so their queues are empty again); returns the message ids."""
    message_ids = [f"msg-{uuid.uuid4().hex[:12]}" for _ in bodies]
    with client.get_topic_sender(topic) as sender:
        sender.send_messages(
            [
                ServiceBusMessage(
                    body,
                    message_id=mid,
                    subject="orders",
                    content_type="application/json",
                    application_properties={"dbfanout-poller": "orders"},
                )
                for mid, body in zip(message_ids, bodies, strict=True)
            ]
        )
    for sub in (subscription, *others):
        done = 0
        with client.get_subscription_receiver(topic, sub, max_wait_time=2) as receiver:
            while done < len(bodies):
                batch = receiver.receive_messages(max_message_count=len(bodies) - done, max_wait_time=5)
                assert batch, f"the messages did not arrive in {topic}/{sub}"
                for message in batch:
                    if sub == subscription:
                        receiver.dead_letter_message(message, reason=reason, error_description=f"{reason} (test)")
                    else:
                        receiver.complete_message(message)
                    done += 1
    return message_ids


@pytest.fixture
def bus(servicebus: Emulator) -> Iterator[ServiceBusClient]:
    with ServiceBusClient.from_connection_string(servicebus.connection_string) as client:
        yield client


def dead_letter(
    client: ServiceBusClient,
    queue: str,
    bodies: Sequence[bytes],
    *,
    reason: str = "HandlerFailed",
    prefix: str = "msg",
    properties: dict[str, Any] | None = None,
) -> list[str]:
    """Put messages into ``queue``'s DLQ (receive and dead-letter each); returns their ids."""
    message_ids = [f"{prefix}-{uuid.uuid4().hex[:12]}" for _ in bodies]
    with client.get_queue_sender(queue) as sender:
        sender.send_messages(
            [
                ServiceBusMessage(
                    body,
                    message_id=mid,
                    subject="orders",
                    content_type="application/json",
                    application_properties={"dbfanout-poller": "orders", **(properties or {})},  # type: ignore[dict-item]
                )
                for mid, body in zip(message_ids, bodies, strict=True)
            ]
        )
    done = 0
    with client.get_queue_receiver(queue, max_wait_time=2) as receiver:
        while done < len(bodies):
            batch = receiver.receive_messages(max_message_count=len(bodies) - done, max_wait_time=5)
            assert batch, "the messages to dead-letter did not arrive"
            for message in batch:
                receiver.dead_letter_message(message, reason=reason, error_description=f"{reason} (test)")
                done += 1
    return message_ids


def said(result: Result) -> str:
    """What the command printed (stderr then stdout), with rich's line wrapping undone."""
    return " ".join((result.stderr + " " + result.stdout).split())


def consume_like_host(bus: ServiceBusClient, queue: str, worker: Worker, done: Any, timeout: float = 60.0) -> None:
    """Receive and settle like the Functions host until ``done()`` holds."""
    deadline = time.monotonic() + timeout
    with bus.get_queue_receiver(queue) as receiver:
        while not done():
            assert time.monotonic() < deadline, "the queue did not reach the expected state in time"
            for message in receiver.receive_messages(max_message_count=20, max_wait_time=0.5):
                settle_received(receiver, message, worker.process)

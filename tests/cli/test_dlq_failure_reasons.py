"""The reason travels with the dead letter (issue 24): ``dlq peek|export`` shows, per dead-lettered
(or poison) message, the failure record its last delivery left — exception type and text (secrets
scrubbed), delivery count, time — for a queue, a topic subscription and a storage queue.

Messages are made and failed the way production does: the poller's real sink sends them, the real
worker fails them with the host's settlement until Service Bus (or the queue trigger's rules)
quarantines them, and the worker writes its record to the state container in Azurite.
"""

from __future__ import annotations

import functools
import json
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
from azure.servicebus import ServiceBusClient, ServiceBusSubQueue
from azure.storage.queue import QueueServiceClient

from poller.sinks.servicebus import ServiceBusSink
from poller.sinks.storagequeue import StorageQueueSink
from shared.failures import FailureRecord, open_failure_store
from shared.models import HandlerContext, RowChange
from shared.servicebus import QueueSender
from shared.storagequeue import StorageQueueSender, poison_queue_name
from tests.cli.conftest import Workspace, said
from worker.consumer import settle_received
from worker.handlers import Handler
from worker.queue_consumer import settle_queue_message
from worker.runtime import HandlerKey, Worker

pytestmark = pytest.mark.integration

SECRET = "S3CRETfailure+key=="
LEAK = f"Endpoint=sb://x.servicebus.windows.net/;SharedAccessKeyName=app;SharedAccessKey={SECRET}"


def leaky(events: list[RowChange], context: HandlerContext) -> None:
    raise ConnectionError(f"downstream refused {[e.pk['id'] for e in events]} using {LEAK}")


def fine(events: list[RowChange], context: HandlerContext) -> None:
    return None


def _limit_deliveries(ws: Workspace, count: int = 3) -> None:
    """The config says what the emulator's entity has: MaxDeliveryCount 3."""
    text = ws.config_path.read_text()
    if "max_delivery_count" not in text:
        ws.config_path.write_text(text.replace('soft_delete_column = "deleted_at"', f"max_delivery_count = {count}"))


def _dlq_count(bus: ServiceBusClient, receiver_of: Callable[..., object]) -> int:
    with receiver_of(sub_queue=ServiceBusSubQueue.DEAD_LETTER, max_wait_time=1) as receiver:  # type: ignore[attr-defined]
        return len(receiver.peek_messages(max_message_count=50))


def _consume_until(
    bus: ServiceBusClient,
    receiver_of: Callable[..., object],
    process: Callable[..., object],
    done: Callable[[], bool],
    timeout: float = 60.0,
) -> None:
    deadline = time.monotonic() + timeout
    with receiver_of(max_wait_time=1) as receiver:  # type: ignore[attr-defined]
        while not done():
            assert time.monotonic() < deadline, "the message did not reach the dead-letter queue in time"
            for message in receiver.receive_messages(max_message_count=10, max_wait_time=0.5):
                settle_received(receiver, message, process)


def _assert_failure_shown(result_json: str, *, deliveries: int, entity: str) -> dict[str, object]:
    (line,) = json.loads(result_json)
    failure: dict[str, object] = line["failure"]
    assert failure is not None, line
    assert failure["error_type"] == "ConnectionError"
    assert str(failure["error"]).startswith("ConnectionError: downstream refused [1]")
    assert "SharedAccessKey=***" in str(failure["error"]) and SECRET not in result_json
    assert failure["delivery_count"] == deliveries and failure["dead_lettered"] is True
    assert failure["entity"] == entity and failure["failed_at"]
    return failure


def test_peek_and_export_show_why_a_queue_message_was_dead_lettered(
    workspace: Workspace, bus: ServiceBusClient
) -> None:
    # Given one row whose handler raises with a connection string in its message
    ws = workspace
    _limit_deliveries(ws)
    ws.source.upsert([1])
    ws.tick(sink=ws.bus_sink(bus))
    config = ws.config
    worker = Worker(config, handlers={"orders": leaky}, failures=open_failure_store(config))
    # When the worker fails it on every delivery until Service Bus dead-letters it (MaxDeliveryCount 3)
    receiver_of = functools.partial(bus.get_queue_receiver, ws.queue)
    _consume_until(bus, receiver_of, worker.process, lambda: _dlq_count(bus, receiver_of) == 1)
    # Then peek --json shows the exception of its last delivery, scrubbed; the table shows it too; so does export
    peek = ws.run("dlq", "peek", ws.queue, "--json")
    assert peek.exit_code == 0, said(peek)
    _assert_failure_shown(peek.stdout, deliveries=3, entity=ws.queue)
    table = ws.run("dlq", "peek", ws.queue)
    assert "ConnectionError: downstream refused" in said(table) and SECRET not in said(table)
    out = ws.root / "dlq.jsonl"
    assert ws.run("dlq", "export", ws.queue, "--out", str(out)).exit_code == 0
    _assert_failure_shown("[" + out.read_text().strip() + "]", deliveries=3, entity=ws.queue)


def test_a_message_that_succeeds_after_a_failure_leaves_no_record(workspace: Workspace, bus: ServiceBusClient) -> None:
    # Given a handler that fails once, then succeeds
    ws = workspace
    ws.source.upsert([1])
    ws.tick(sink=ws.bus_sink(bus))
    config = ws.config
    store = open_failure_store(config)
    calls: list[int] = []

    def flaky(events: list[RowChange], context: HandlerContext) -> None:
        calls.append(context.delivery_count)
        if len(calls) == 1:
            leaky(events, context)

    worker = Worker(config, handlers={"orders": flaky}, failures=store)
    receiver_of = functools.partial(bus.get_queue_receiver, ws.queue)
    bodies: list[bytes] = []
    with receiver_of(max_wait_time=1) as receiver:
        deadline = time.monotonic() + 30
        while len(calls) < 2:
            assert time.monotonic() < deadline
            for message in receiver.receive_messages(max_message_count=1, max_wait_time=0.5):
                bodies.append(b"".join(message.body))
                failed = not settle_received(receiver, message, worker.process)
                # Then after the failure the record exists; after the success it is gone
                assert (store.lookup(ws.queue, bodies[-1]) is not None) is failed
    assert calls == [1, 2]


def test_peek_shows_why_a_subscription_message_was_dead_lettered(
    topic_workspace: Workspace, bus: ServiceBusClient
) -> None:
    # Given a topic poller whose "search" handler raises (MaxDeliveryCount 3), "audit" succeeds
    ws = topic_workspace
    ws.source.upsert([1])
    config = ws.config
    cfg = config.poller("orders")
    ws.tick(sink=ServiceBusSink(cfg, QueueSender(bus, cfg.queue, kind="topic")))
    handlers: dict[HandlerKey, Handler] = {("orders", "search"): leaky, ("orders", "audit"): fine}
    worker = Worker(config, handlers=handlers, failures=open_failure_store(config))
    # When both subscriptions consume it
    search = functools.partial(bus.get_subscription_receiver, ws.queue, "search")
    _consume_until(
        bus, search, functools.partial(worker.process, subscription="search"), lambda: _dlq_count(bus, search) == 1
    )
    # Then peek of TOPIC/search shows the reason; its record is the subscription's, not the topic's
    peek = ws.run("dlq", "peek", f"{ws.queue}/search", "--json")
    assert peek.exit_code == 0, said(peek)
    failure = _assert_failure_shown(peek.stdout, deliveries=3, entity=f"{ws.queue}/search")
    assert failure["subscription"] == "search"


def test_peek_and_export_show_why_a_storage_queue_message_was_poisoned(
    tmp_path: Path, azurite: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.cli.test_dlq_storage_queue import TOML, PoisonWorkspace
    from tests.poller.tick_support import SourceTable

    conn = azurite.connection_string  # type: ignore[attr-defined]
    service = QueueServiceClient.from_connection_string(conn)
    queue = f"orders-{uuid.uuid4().hex[:10]}"
    main, poison = service.create_queue(queue), service.create_queue(poison_queue_name(queue))
    app_name, container = f"app{uuid.uuid4().hex[:8]}", f"state-{uuid.uuid4().hex[:10]}"
    source = SourceTable(f"sqlite:///{tmp_path / 'source.db'}")
    config_path = tmp_path / "dbfanout.toml"
    config_path.write_text(
        TOML.format(app=app_name, container=container, queue=queue).replace("batch_size = 2", "batch_size = 1")
    )
    monkeypatch.setenv("ORDERS_DB_URL", str(source.engine.url))
    monkeypatch.setenv("DBFANOUT_STATE", conn)
    monkeypatch.chdir(tmp_path)
    ws = PoisonWorkspace(tmp_path, config_path, queue, main, poison, source, container, app_name, azurite)  # type: ignore[arg-type]
    try:
        # Given one row in a storage queue whose handler raises with a connection string
        source.upsert([1])
        from poller.sources.keyset.source import SqlSource
        from poller.state.blob import open_state_store
        from poller.tick.lifecycle import run_tick
        from shared.config import load_config
        from shared.settings import StorageConnection

        config = load_config(config_path, app_root=tmp_path)
        cfg = config.poller("orders")
        store = open_state_store(StorageConnection(connection_string=conn), container, app_name, "orders")
        run_tick(cfg, SqlSource(cfg), store, StorageQueueSink(cfg, StorageQueueSender(main)), owner_id="test")
        worker = Worker(config, handlers={"orders": leaky}, failures=open_failure_store(config))
        # When it fails maxDequeueCount (5) times and moves to <queue>-poison (a new message id there)
        deadline = time.monotonic() + 60
        while not ws.texts(poison):
            assert time.monotonic() < deadline, "the message did not reach the poison queue"
            for message in main.receive_messages(max_messages=1, visibility_timeout=30):
                settle_queue_message(main, poison, message, worker.process, max_dequeue_count=5)
        # Then peek --json and export show the reason of its fifth, last delivery
        peek = ws.run("dlq", "peek", queue, "--json")
        assert peek.exit_code == 0, said(peek)
        _assert_failure_shown(peek.stdout, deliveries=5, entity=queue)
        out = tmp_path / "poison.jsonl"
        assert ws.run("dlq", "export", queue, "--out", str(out)).exit_code == 0
        _assert_failure_shown("[" + out.read_text().strip() + "]", deliveries=5, entity=queue)
    finally:
        main.delete_queue()
        poison.delete_queue()


def test_a_record_older_than_the_dead_lettered_copy_is_marked_stale(
    workspace: Workspace, bus: ServiceBusClient
) -> None:
    # Given a failure record of an earlier copy of this body (it was replayed, then dead-lettered
    # again without a delivery that raised: a crash, say)
    from tests.cli.conftest import dead_letter

    ws = workspace
    ws.tick()  # the poller's first tick creates the state container
    body = b'{"schema": "dbfanout.batch/1", "poller": "orders"}'
    store = open_failure_store(ws.config)
    old = FailureRecord(ws.queue, "orders", "m-old", 3, "2020-01-01T00:00:00+00:00", "ValueError", "ValueError: old")
    store.record(old, body)
    dead_letter(bus, ws.queue, [body])
    # When the operator peeks; Then the record is shown, marked stale
    (line,) = json.loads(ws.run("dlq", "peek", ws.queue, "--json").stdout)
    assert line["failure"]["error"] == "ValueError: old" and line["failure"]["stale"] is True

"""Telemetry under ``dbfanout run`` (issue 24): the real ``function_app.py`` on the local host,
with the Service Bus emulator, Azurite, a SQLite source and an in-memory OpenTelemetry SDK.

One trace links the poller's send span to the worker's span for the same message; the commit ->
handler histogram gets one observation per event; a poisoned event counts as dead-lettered once,
its failure record explains it (scrubbed), and no log line holds the secret in its exception.
"""

from __future__ import annotations

import logging
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from azure.servicebus import ServiceBusClient, ServiceBusSubQueue
from opentelemetry.sdk.trace import ReadableSpan

from dbfanout.host import LocalHost
from sbemulator import Emulator
from sbemulator.testing import unique_queue
from shared.config import load_config
from shared.failures import open_failure_store
from tests.host.app_support import SOURCE_DDL, AppDir, sqlite_engine, wait_for
from tests.support import otel
from tests.support.azurite import Azurite

pytestmark = pytest.mark.integration

ROWS = 12
POISON = 7
SECRET = "S3CRETrun+key=="

HANDLER = f"""
RECEIVED = []

def handle(events, context):
    for event in events:
        if event.pk["id"] == {POISON}:
            raise ConnectionError(
                "cannot write row 7 with Endpoint=sb://x/;SharedAccessKeyName=k;SharedAccessKey={SECRET}"
            )
    RECEIVED.extend(event.event_id for event in events)
"""


@pytest.fixture
def app(tmp_path: Path, azurite: Azurite, servicebus: Emulator, restore_environ: None) -> Iterator[AppDir]:
    queue = unique_queue(
        servicebus, "otel", requires_duplicate_detection=True, lock_duration="PT5S", max_delivery_count=3
    )
    module = f"otel_handler_{uuid.uuid4().hex[:8]}"
    app = AppDir.create(
        tmp_path,
        queue=queue,
        storage=azurite.connection_string,
        servicebus=servicebus.connection_string,
        handler=f"{module}:handle",
        poller_toml="max_delivery_count = 3",
    )
    (tmp_path / f"{module}.py").write_text(HANDLER)
    engine = sqlite_engine(tmp_path / "source.db")
    with engine.begin() as conn:
        conn.exec_driver_sql(SOURCE_DDL)
        for i in range(1, ROWS + 1):
            conn.execute(
                sa.text("INSERT INTO orders (id, version, v, committed_at) VALUES (:i, :i, :v, 0)"),
                {"i": i, "v": f"v{i}"},
            )
    engine.dispose()
    for name in ("function_app", "handlers", "handlers.example", module):
        sys.modules.pop(name, None)  # the app folder's own modules, like a fresh worker
    yield app
    for name in ("function_app", module):
        sys.modules.pop(name, None)


def _destination(span: ReadableSpan) -> object:
    return dict(span.attributes or {}).get("messaging.destination.name")


def test_dbfanout_run_traces_times_and_explains_every_event(app: AppDir, caplog: pytest.LogCaptureFixture) -> None:
    otel.install()
    otel.SPANS.clear()
    handled_before = otel.total("dbfanout.events_handled", poller="orders", queue=app.queue)
    # Given the real app on the local host (timer every second, queue trigger on the emulator)
    host = LocalHost(app.root, "function_app:app", grace_seconds=10)
    caplog.set_level(logging.INFO, logger="dbfanout")
    host.start()
    try:
        # When it sends 12 rows in one message, the handler fails on row 7, the message is split
        # and row 7's single fails its 3 deliveries into the dead-letter queue
        wait_for(
            lambda: (
                otel.total("dbfanout.events.dead_lettered", poller="orders", queue=app.queue) >= 1
                and otel.total("dbfanout.events_handled", poller="orders", queue=app.queue) - handled_before >= ROWS - 1
            ),
            90,
            "the good rows handled and the poison row dead-lettered",
        )
    finally:
        host.stop()
    module = sys.modules[[m for m in sys.modules if m.startswith("otel_handler_")][-1]]
    assert sorted(set(module.RECEIVED)) == sorted(module.RECEIVED) and len(module.RECEIVED) == ROWS - 1
    # Then one trace links the poller's send span to the worker's span of the same message
    sends = [s for s in otel.spans("dbfanout.send") if _destination(s) == app.queue]
    delivers = [s for s in otel.spans("dbfanout.deliver") if _destination(s) == app.queue]
    (send,) = sends
    first = [d for d in delivers if dict(d.attributes or {})["dbfanout.events"] == ROWS]
    assert first and all(d.parent is not None and d.parent.span_id == send.context.span_id for d in first)
    assert {d.context.trace_id for d in delivers} == {send.context.trace_id}  # singles too
    # And the commit -> handler histogram has one observation per handled event (read time: keyset)
    latency = [
        (attrs, p)
        for attrs, p in otel.points().get("dbfanout.commit_to_handler", [])
        if attrs.get("queue") == app.queue
    ]
    assert [(attrs["commit_time"], p.count) for attrs, p in latency] == [("read", ROWS - 1)]
    # And the poisoned event is dead-lettered once, its failure explained and scrubbed
    assert otel.total("dbfanout.events.dead_lettered", poller="orders", queue=app.queue) == 1
    assert otel.total("dbfanout.messages_split", poller="orders", queue=app.queue) == 1
    failed = [s for s in delivers if s.status.status_code.name == "ERROR"]
    assert failed and all(SECRET not in str(e.attributes) for s in failed for e in s.events)
    assert not any(SECRET in caplog.handler.format(r) for r in caplog.records)
    # And the dead-lettered message's failure record says why (what `dbfanout dlq peek` shows)
    config = load_config(app.root / "dbfanout.toml", app_root=app.root)
    with (
        ServiceBusClient.from_connection_string(app.settings["DBFANOUT_SERVICEBUS"]) as client,
        client.get_queue_receiver(app.queue, sub_queue=ServiceBusSubQueue.DEAD_LETTER) as receiver,
    ):
        (dead,) = receiver.peek_messages(max_message_count=10)
    record = open_failure_store(config).lookup(app.queue, b"".join(dead.body))
    assert record is not None and record.dead_lettered and record.delivery_count == 3
    assert record.error.startswith("ConnectionError: cannot write row 7") and SECRET not in record.error

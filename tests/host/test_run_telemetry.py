"""Telemetry and failure reasons under ``dbfanout run`` (issue 24): the real ``function_app.py`` on
the local host, with the Service Bus emulator, Azurite, a SQLite source and an in-memory
OpenTelemetry SDK — for a queue, a topic subscription and a storage queue.

One trace links the poller's send span to the worker's span for the same message; the commit ->
handler histogram gets one observation per handled event; a poisoned event counts as dead-lettered
once; ``dlq peek --json`` shows its exception, scrubbed; no log line holds the secret.
"""

from __future__ import annotations

import json
import logging
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from azure.storage.queue import QueueServiceClient
from opentelemetry.sdk.trace import ReadableSpan
from typer.testing import CliRunner

from dbfanout.cli import app as cli
from dbfanout.host import LocalHost
from dbfanout.ops.entities import emulator_config_for
from sbemulator import Emulator
from sbemulator.testing import unique_queue
from shared.config import load_config
from shared.storagequeue import poison_queue_name
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


@dataclass
class Case:
    app: AppDir
    module: str
    entity: str  # what `dbfanout dlq` is given
    attrs: dict[str, str]  # the worker's metric attributes


def _create(kind: str, root: Path, azurite: Azurite, servicebus: Emulator, module: str) -> Case:
    common: dict[str, Any] = {"storage": azurite.connection_string, "servicebus": servicebus.connection_string}
    if kind == "queue":
        queue = unique_queue(
            servicebus, "otel", requires_duplicate_detection=True, lock_duration="PT5S", max_delivery_count=3
        )
        app = AppDir.create(
            root, queue=queue, handler=f"{module}:handle", poller_toml="max_delivery_count = 3", **common
        )
        return Case(app, module, queue, {"poller": "orders", "queue": queue})
    if kind == "subscription":
        topic = f"otel-{uuid.uuid4().hex[:10]}"
        subs: dict[str, dict[str, str | int]] = {"search": {"handler": f"{module}:handle", "max_delivery_count": 3}}
        app = AppDir.create(root, queue=topic, subscriptions=subs, **common)
        config = load_config(app.root / "dbfanout.toml", settings=app.settings)
        (declared,) = emulator_config_for(config, lock_duration="PT5S").topics
        servicebus.create_topic(declared)
        return Case(app, module, f"{topic}/search", {"poller": "orders", "queue": topic, "subscription": "search"})
    queue = f"otel-{uuid.uuid4().hex[:10]}"
    service = QueueServiceClient.from_connection_string(azurite.connection_string)
    service.create_queue(queue)
    service.create_queue(poison_queue_name(queue))
    app = AppDir.create(
        root,
        queue=queue,
        handler=f"{module}:handle",
        transport="storage-queue",
        queues_json={"maxPollingInterval": "00:00:00.500", "maxDequeueCount": 3},
        poller_toml="max_delivery_count = 3",
        **common,
    )
    return Case(app, module, queue, {"poller": "orders", "queue": queue})


@pytest.fixture(params=["queue", "subscription", "storage-queue"])
def case(
    request: pytest.FixtureRequest, tmp_path: Path, azurite: Azurite, servicebus: Emulator, restore_environ: None
) -> Iterator[Case]:
    module = f"otel_handler_{uuid.uuid4().hex[:8]}"
    case = _create(request.param, tmp_path, azurite, servicebus, module)
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
    yield case
    for name in ("function_app", module):
        sys.modules.pop(name, None)


def _destination(span: ReadableSpan) -> object:
    return dict(span.attributes or {}).get("messaging.destination.name")


def test_dbfanout_run_traces_times_and_explains_every_event(case: Case, caplog: pytest.LogCaptureFixture) -> None:
    otel.install()
    otel.SPANS.clear()
    app, attrs = case.app, case.attrs
    # Given the real app on the local host (timer every second, its trigger on the emulator or Azurite)
    host = LocalHost(app.root, "function_app:app", grace_seconds=10)
    caplog.set_level(logging.INFO, logger="dbfanout")
    host.start()
    try:
        # When it sends 12 rows in one message, the handler fails on row 7, the message is split
        # and row 7's single fails its 3 deliveries into the dead-letter (poison) queue
        wait_for(
            lambda: (
                otel.total("dbfanout.events.dead_lettered", **attrs) >= 1
                and otel.total("dbfanout.events_handled", **attrs) >= ROWS - 1
            ),
            90,
            "the good rows handled and the poison row dead-lettered",
        )
    finally:
        host.stop()
    received = sys.modules[case.module].RECEIVED
    assert sorted(set(received)) == sorted(received) and len(received) == ROWS - 1
    # Then one trace links the poller's send span to the worker's span of the same message
    destination = attrs["queue"]
    (send,) = [s for s in otel.spans("dbfanout.send") if _destination(s) == destination]
    delivers = [s for s in otel.spans("dbfanout.deliver") if _destination(s) == destination]
    first = [d for d in delivers if dict(d.attributes or {})["dbfanout.events"] == ROWS]
    assert first and all(d.parent is not None and d.parent.span_id == send.context.span_id for d in first)
    assert {d.context.trace_id for d in delivers} == {send.context.trace_id}  # the singles too
    # And the commit -> handler histogram has one observation per handled message (keyset: the poller's
    # read time, one per message); the good rows were handled as the split's singles
    latency = [
        (point_attrs, p)
        for point_attrs, p in otel.points().get("dbfanout.commit_to_handler", [])
        if point_attrs.get("queue") == destination
    ]
    assert [(a["commit_time"], a.get("subscription"), p.count) for a, p in latency] == [
        ("read", attrs.get("subscription"), ROWS - 1)
    ]
    # And the poisoned event is dead-lettered once; its spans and the logs hold no secret
    assert otel.total("dbfanout.events.dead_lettered", **attrs) == 1
    assert otel.total("dbfanout.messages_split", **attrs) == 1
    failed = [s for s in delivers if s.status.status_code.name == "ERROR"]
    assert failed and all(SECRET not in str(e.attributes) for s in failed for e in s.events)
    assert not any(SECRET in caplog.handler.format(r) for r in caplog.records)
    # And `dbfanout dlq peek --json` shows why it failed, scrubbed
    peek = CliRunner().invoke(cli, ["dlq", "peek", case.entity, "--json", "--config", str(app.root / "dbfanout.toml")])
    assert peek.exit_code == 0, peek.output
    (line,) = json.loads(peek.stdout)
    failure = line["failure"]
    assert failure["error"].startswith("ConnectionError: cannot write row 7")
    assert "SharedAccessKey=***" in failure["error"] and SECRET not in peek.stdout
    assert failure["delivery_count"] == 3 and failure["dead_lettered"] is True
    assert failure["subscription"] == attrs.get("subscription")

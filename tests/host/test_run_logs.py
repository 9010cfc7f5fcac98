"""``dbfanout run``'s log lines carry their ids: poller, batch id, message id, delivery count.

The real host in a subprocess (``python -m dbfanout.cli run``), a one-row SQLite source and a
handler that always fails, so one run shows the poller's lines (batch enqueued, checkpoint
committed) and the worker's (handler failed). Text by default, JSON lines on request.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from sbemulator import Emulator
from sbemulator.testing import unique_queue
from tests.host.app_support import SOURCE_DDL, AppDir, HostProcess, sqlite_engine, wait_for
from tests.support.azurite import Azurite

pytestmark = pytest.mark.integration

FAILING_HANDLER = 'def handle(events, context):\n    raise RuntimeError("the handler refuses (injected)")\n'


def _app(tmp_path: Path, azurite: Azurite, servicebus: Emulator) -> AppDir:
    """An app whose one source row is handed to a handler that always fails."""
    queue = unique_queue(servicebus, "logs", max_delivery_count=10, lock_duration="PT30S")
    app = AppDir.create(
        tmp_path / "app", queue=queue, storage=azurite.connection_string, servicebus=servicebus.connection_string
    )
    (app.root / "handlers" / "failing.py").write_text(FAILING_HANDLER)
    toml = app.root / "dbfanout.toml"
    toml.write_text(toml.read_text().replace("handlers.example:handle", "handlers.failing:handle"))
    engine = sqlite_engine(app.root / "source.db")
    with engine.begin() as conn:
        conn.exec_driver_sql(SOURCE_DDL)
        conn.exec_driver_sql("CREATE INDEX ix_orders_keyset ON orders (version, id)")
        conn.exec_driver_sql("INSERT INTO orders (id, version, v) VALUES (1, 1, 'x')")
    engine.dispose()
    return app


def _run_until_the_handler_failed(app: AppDir, *args: str) -> str:
    host = HostProcess(app, *args).start()
    try:
        wait_for(lambda: "handler failed" in host.log_text(), 120, "the handler's failure in the host log")
        # The worker can fail the batch before the poller's checkpoint write (after the send) returns
        wait_for(lambda: "checkpoint committed" in host.log_text(), 60, "the poller's commit in the host log")
    finally:
        host.stop_quietly()
    return host.log_text()


def _line(log: str, message: str) -> str:
    lines = [line for line in log.splitlines() if message in line]
    assert lines, f"no {message!r} line in:\n{log[-3000:]}"
    return lines[0]


def test_run_renders_each_lines_ids_as_key_value_text(tmp_path: Path, azurite: Azurite, servicebus: Emulator) -> None:
    # Given an app whose handler fails; When `dbfanout run` runs with its default log format
    log = _run_until_the_handler_failed(_app(tmp_path, azurite, servicebus))
    # Then the poller's lines name the poller and the batch, the commit its fencing token
    enqueued = _line(log, "batch enqueued")
    assert "poller=orders" in enqueued and re.search(r" batch_id=\S+", enqueued), enqueued
    batch_id = re.search(r" batch_id=(\S+)", enqueued).group(1)  # type: ignore[union-attr]
    committed = _line(log, "checkpoint committed")
    assert f"batch_id={batch_id}" in committed and re.search(r" fencing_token=\d+", committed), committed
    # And the worker's failure names the poller, the batch, the message and its delivery count
    failed = _line(log, "handler failed")
    assert "poller=orders" in failed and f"batch_id={batch_id}" in failed, failed
    assert re.search(r" message_id=\S+", failed) and re.search(r" delivery_count=\d+", failed), failed


@pytest.mark.parametrize("how", ["flag", "env"])
def test_run_writes_json_lines_with_the_same_fields_on_request(
    tmp_path: Path, azurite: Azurite, servicebus: Emulator, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    # Given the same app; When `dbfanout run --log-format json` (or DBFANOUT_LOG_FORMAT=json) runs
    if how == "env":
        monkeypatch.setenv("DBFANOUT_LOG_FORMAT", "json")
    args = ("--log-format", "json") if how == "flag" else ()
    log = _run_until_the_handler_failed(_app(tmp_path, azurite, servicebus), *args)
    # Then the log lines are JSON objects carrying the ids as fields
    docs: list[dict[str, Any]] = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    by_message = {doc["message"]: doc for doc in reversed(docs)}  # the first of each
    enqueued = by_message["batch enqueued"]
    assert enqueued["poller"] == "orders" and enqueued["batch_id"] and enqueued["level"] == "INFO"
    committed = by_message["checkpoint committed"]
    assert committed["batch_id"] == enqueued["batch_id"] and committed["fencing_token"] >= 1
    [failed] = [doc for message, doc in by_message.items() if message.startswith("handler failed")]
    assert failed["poller"] == "orders" and failed["batch_id"] == enqueued["batch_id"]
    assert failed["message_id"] and failed["delivery_count"] >= 1

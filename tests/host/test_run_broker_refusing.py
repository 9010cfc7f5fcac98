"""A refusing broker under ``dbfanout run`` is a state: one WARNING, a backing-off retry rate, the
checkpoint held, ``status`` showing it, delivery resuming by itself, nothing lost.

The real host in a subprocess with the real function_app.py. A full queue: the emulator queue has
a small quota (MaxSizeInMegabytes, in bytes here) and the handler holds every message until the
test opens a gate file, so the worker's locked messages fill the queue. An unreachable broker:
the app reaches the emulator through a TCP proxy that resets every connection while "down".
The emulator counts the transfers it accepted and refused (``faults.send_counts``): the poller's
attempts.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from typer.testing import CliRunner

from dbfanout.cli import app as cli
from sbemulator import Emulator
from sbemulator.testing import unique_queue
from tests.host.app_support import SOURCE_DDL, AppDir, HostProcess, Target, sqlite_engine, wait_for
from tests.support.azurite import Azurite
from tests.support.faultproxy import FaultProxy

pytestmark = pytest.mark.integration

ROWS = 300
#: How long the test keeps the broker refusing while it counts the poller's attempts (seconds).
#: The timer fires every second; the backoff's waits (0.5-1, 1-2, 2-4, 4-8, 8-16 s) allow at most 5
#: attempts in 20 s after the first. Main tried at every tick that was not busy failing: 8 in 16 s.
REFUSAL_WINDOW = 20.0
MAX_ATTEMPTS = 5

GATED_HANDLER = '''"""The example handler, held back until the test creates the file ``gate`` in the app folder."""
import os
import time

from handlers.example import handle as replicate

GATE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "gate")


def handle(events, context):
    while not os.path.exists(GATE):  # the worker holds its locked messages: the queue fills up
        time.sleep(0.05)
    replicate(events, context)
'''


def _app(tmp_path: Path, azurite: Azurite, servicebus_connection: str, queue: str, handler: str) -> AppDir:
    app = AppDir.create(
        tmp_path / "app",
        queue=queue,
        storage=azurite.connection_string,
        servicebus=servicebus_connection,
        batch_size=10,
        handler=handler,
    )
    (app.root / "handlers" / "gated.py").write_text(GATED_HANDLER)
    engine = sqlite_engine(app.root / "source.db")
    with engine.begin() as conn:
        conn.exec_driver_sql(SOURCE_DDL)
        conn.exec_driver_sql("CREATE INDEX ix_orders_keyset ON orders (version, id)")
    engine.dispose()
    return app


def _insert(app: AppDir, first: int, count: int) -> None:
    engine = sqlite_engine(app.root / "source.db")
    with engine.begin() as conn:
        conn.execute(
            sa.text("INSERT INTO orders (id, version, v) VALUES (:id, :id, :v)"),
            [{"id": i, "v": f"row {i}"} for i in range(first, first + count)],
        )
    engine.dispose()


def _status(app: AppDir) -> dict[str, Any]:
    result = CliRunner().invoke(cli, ["status", "orders", "--json", "--config", str(app.root / "dbfanout.toml")])
    [row] = json.loads(result.stdout)
    return dict(row)


def _lines(log: str, level: str) -> list[str]:
    return [line for line in log.splitlines() if re.search(rf"\b{level}\b", line)]


def _met_refusal(log: str) -> bool:
    """The poller met the refusal: it said so (or, before refusals were a state, its tick failed)."""
    return "the broker refuses sends" in log or "timer function failed" in log


def _observe_backoff(servicebus: Emulator, queue: str, host: HostProcess) -> int:
    """Refused transfers during :data:`REFUSAL_WINDOW` seconds of a refusal that has begun.

    A rate needs a window of time: this waits for the window to pass (the host keeps ticking)."""
    before = servicebus.faults.send_counts(queue)["refused"]
    started = time.monotonic()
    wait_for(lambda: time.monotonic() - started >= REFUSAL_WINDOW, REFUSAL_WINDOW + 5, "the observation window")
    assert host.alive(), host.log_tail()
    return servicebus.faults.send_counts(queue)["refused"] - before


def test_a_full_queue_warns_once_backs_off_holds_the_checkpoint_and_resumes(
    tmp_path: Path, azurite: Azurite, servicebus: Emulator
) -> None:
    # Given a queue that holds 40 KB and a handler that holds every message back
    queue = unique_queue(
        servicebus,
        "full",
        requires_duplicate_detection=True,
        lock_duration="PT60S",
        max_message_size=32 * 1024,
        max_size_bytes=40 * 1024,
    )
    app = _app(tmp_path, azurite, servicebus.connection_string, queue, "handlers.gated:handle")
    _insert(app, 1, ROWS)
    target = Target(app.root / "target.db")
    host = HostProcess(app).start()
    try:
        # When the poller fills the queue
        wait_for(lambda: servicebus.faults.send_counts(queue)["refused"] > 0, 90, "the poller to meet a full queue")
        # Then its attempts back off while the timer fires every second
        refused = _observe_backoff(servicebus, queue, host)
        assert 1 <= refused <= MAX_ATTEMPTS, f"{refused} refused sends in {REFUSAL_WINDOW} s"
        # And status shows the refusal, and the checkpoint holds short of the rows that wait
        row = _status(app)
        assert row["sink_refusing"]["reason"] == "queue_full", row
        assert "maximum entity size" in row["sink_refusing"]["error"], row
        checkpoint = row["checkpoint"]["cursor"]
        assert checkpoint is not None and checkpoint["value"] < ROWS, row

        # When the handler lets the messages go (the queue drains)
        (app.root / "gate").write_text("open")
        # Then every row arrives, nothing lost, and the refusal's end is logged once
        expected = set(range(1, ROWS + 1))
        wait_for(lambda: set(target.rows()) == expected, 120, "every row in the target")
        wait_for(lambda: "the broker accepts sends again" in host.log_text(), 30, "the refusal's end in the log")
        wait_for(lambda: _status(app)["sink_refusing"] is None, 30, "status to show the refusal over")
    finally:
        host.stop_quietly()
        target.close()
    log = host.log_text()
    # And the whole refusal logged one WARNING and no ERROR, no traceback
    warnings = _lines(log, "WARNING")
    assert len([w for w in warnings if "the broker refuses sends" in w]) == 1, "\n".join(warnings)
    assert not _lines(log, "ERROR") and "Traceback" not in log, log[-5000:]
    [ended] = [line for line in log.splitlines() if "the broker accepts sends again" in line]
    assert "INFO" in ended and "queue is full" in ended and "reason=queue_full" in ended, ended


def test_an_unreachable_broker_warns_once_backs_off_and_resumes(
    tmp_path: Path, azurite: Azurite, servicebus: Emulator
) -> None:
    # Given the app reaching the emulator through a proxy, and the example handler
    queue = unique_queue(servicebus, "down", requires_duplicate_detection=True, lock_duration="PT30S")
    proxy = FaultProxy(servicebus.port)
    connection = servicebus.connection_string.replace(f":{servicebus.port};", f":{proxy.port};")
    app = _app(tmp_path, azurite, connection, queue, "handlers.example:handle")
    _insert(app, 1, 20)
    target = Target(app.root / "target.db")
    host = HostProcess(app).start()
    try:
        wait_for(lambda: len(target.rows()) == 20, 90, "the first rows in the target")
        # When the broker becomes unreachable while rows keep coming
        proxy.go_down()
        _insert(app, 21, 40)
        wait_for(lambda: _met_refusal(host.log_text()), 90, "the poller to meet a dead broker")
        # Then status shows it, and no row past the checkpoint was lost when it comes back
        wait_for(lambda: (_status(app).get("sink_refusing") or {}).get("reason") == "unreachable", 30, "status")
        proxy.come_up()
        wait_for(lambda: set(target.rows()) == set(range(1, 61)), 120, "every row in the target")
        wait_for(lambda: "the broker accepts sends again" in host.log_text(), 30, "the refusal's end in the log")
    finally:
        host.stop_quietly()
        target.close()
        proxy.close()
    log = host.log_text()
    # And the poller warned once and never failed a tick
    warnings = [line for line in _lines(log, "WARNING") if "the broker refuses sends" in line]
    assert len(warnings) == 1 and "reason=unreachable" in warnings[0], "\n".join(warnings)
    assert "timer function failed" not in log, log[-5000:]

"""Quiet when idle: under ``dbfanout run`` an idle poller writes no INFO line per tick.

The real host in a subprocess (``--log-level DEBUG``, so the idle ticks' DEBUG lines show that
the timer did fire), an empty SQLite source on a one-second schedule. The five-minute summary's
timing is unit-tested in tests/poller/tick/test_tick_summary.py.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from sbemulator import Emulator
from sbemulator.testing import unique_queue
from tests.host.app_support import SOURCE_DDL, AppDir, HostProcess, sqlite_engine, wait_for
from tests.support.azurite import Azurite

pytestmark = pytest.mark.integration

IDLE_TICKS = 8


def _ticks(log: str, level: str) -> int:
    return len(re.findall(rf" {level} dbfanout\.poller\.functions: tick done ", log))


def _all_ticks(log: str) -> int:
    return _ticks(log, "DEBUG") + _ticks(log, "INFO")


def test_idle_ticks_log_at_debug_and_nothing_at_info(tmp_path: Path, azurite: Azurite, servicebus: Emulator) -> None:
    # Given an app whose source table is empty
    queue = unique_queue(servicebus, "idle", lock_duration="PT30S")
    app = AppDir.create(
        tmp_path / "app", queue=queue, storage=azurite.connection_string, servicebus=servicebus.connection_string
    )
    engine = sqlite_engine(app.root / "source.db")
    with engine.begin() as conn:
        conn.exec_driver_sql(SOURCE_DDL)
        conn.exec_driver_sql("CREATE INDEX ix_orders_keyset ON orders (version, id)")
    engine.dispose()
    host = HostProcess(app, "--log-level", "DEBUG").start()
    try:
        # When the timer fires IDLE_TICKS times
        wait_for(lambda: _all_ticks(host.log_text()) >= IDLE_TICKS, 90, f"{IDLE_TICKS} idle ticks")
    finally:
        host.stop_quietly()
    log = host.log_text()
    # Then every idle tick logged at DEBUG, none at INFO, and the poller wrote no other INFO line
    assert _ticks(log, "INFO") == 0, log[-3000:]
    assert _ticks(log, "DEBUG") >= IDLE_TICKS
    poller_info = [line for line in log.splitlines() if re.search(r" INFO dbfanout\.poller\.", line)]
    assert poller_info == [], "\n".join(poller_info)

"""A poller with ``sessions = true`` under ``dbfanout run``: per-key order end to end (issue 13).

SQLite source written concurrently (inserts, updates, soft deletes) → poller timer → a
session-enabled emulator queue (one message per key, in the key's session) → the session trigger
→ a handler that fails the first delivery of about a quarter of the events and records, in order,
every version it handled. Each key's versions must be handled in increasing order, across
redeliveries, and every key must end at its final version. (With sessions every message holds one
event, so the worker's split path never applies: nothing is left to split.)
"""

from __future__ import annotations

import json
import sqlite3
import textwrap
from itertools import pairwise
from pathlib import Path

import pytest
import sqlalchemy as sa

from sbemulator import Emulator
from sbemulator.testing import unique_queue
from tests.conftest import FULL
from tests.host.app_support import AppDir, HostProcess, SourceWriter, wait_for
from tests.support.azurite import Azurite

pytestmark = pytest.mark.integration

ROWS = 1_000 if FULL else 120

HANDLER = """
import os
import sqlite3
import zlib


def handle(events, context):
    with sqlite3.connect(os.environ["ORDERCHECK_DB"], timeout=30) as conn:
        for event in events:
            if context.delivery_count == 1 and zlib.crc32(event.event_id.encode()) % 4 == 0:
                conn.execute("INSERT INTO failures (pk) VALUES (?)", (event.pk["id"],))
                conn.commit()
                raise RuntimeError("a transient failure on the first delivery")
            conn.execute("INSERT INTO seen (pk, version) VALUES (?, ?)", (event.pk["id"], event.cursor))
"""


def _session_app(tmp_path: Path, azurite: Azurite, servicebus: Emulator) -> tuple[AppDir, Path]:
    queue = unique_queue(
        servicebus,
        "ordered",
        requires_session=True,
        requires_duplicate_detection=True,
        max_delivery_count=10,
        lock_duration="PT30S",
    )
    app = AppDir.create(
        tmp_path / "app",
        queue=queue,
        storage=azurite.connection_string,
        servicebus=servicebus.connection_string,
        # One session per key: a slot holds a drained session for sessionIdleTimeout, so more slots
        host_json={"maxConcurrentSessions": 16, "sessionIdleTimeout": "00:00:01"},
    )
    config = app.root / "dbfanout.toml"
    text = config.read_text().replace('handler = "handlers.example:handle"', 'handler = "handlers.ordercheck:handle"')
    config.write_text(text + "sessions = true\n")
    (app.root / "handlers" / "ordercheck.py").write_text(textwrap.dedent(HANDLER))
    seen = app.root / "seen.db"
    with sqlite3.connect(seen) as conn:
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("CREATE TABLE seen (n INTEGER PRIMARY KEY AUTOINCREMENT, pk INTEGER, version INTEGER)")
        conn.execute("CREATE TABLE failures (n INTEGER PRIMARY KEY AUTOINCREMENT, pk INTEGER)")
    local = app.root / "local.settings.json"
    doc = json.loads(local.read_text())
    doc["Values"]["ORDERCHECK_DB"] = str(seen)
    local.write_text(json.dumps(doc, indent=2))
    return app, seen


def _handled(seen: Path) -> tuple[dict[int, list[int]], int]:
    """Each key's handled versions in the order they were handled, and how many first deliveries failed."""
    with sqlite3.connect(seen, timeout=30) as conn:
        order: dict[int, list[int]] = {}
        for pk, version in conn.execute("SELECT pk, version FROM seen ORDER BY n"):
            order.setdefault(int(pk), []).append(int(version))
        failures = int(conn.execute("SELECT count(*) FROM failures").fetchone()[0])
    return order, failures


def test_run_keeps_per_key_order_for_a_session_poller_across_redeliveries(
    tmp_path: Path, azurite: Azurite, servicebus: Emulator
) -> None:
    # Given a sessions = true poller, its session queue and a running host
    app, seen = _session_app(tmp_path, azurite, servicebus)
    # Small transactions spread over several ticks, so keys change again after being sent
    writer = SourceWriter(app.root / "source.db", ROWS, per_txn=5, pause=0.3)
    host = HostProcess(app).start()
    try:
        # When rows are inserted, updated and soft-deleted while it runs
        writer.start()
        writer.join(180)
        with writer.engine.connect() as conn:
            final = {int(i): int(v) for i, v in conn.execute(sa.text("SELECT id, version FROM orders"))}

        def caught_up() -> bool:
            order, _ = _handled(seen)
            return all(order.get(pk, [0])[-1] >= version for pk, version in final.items())

        wait_for(caught_up, 180, "every key's final version to be handled")
        order, failures = _handled(seen)
        # Then each key's versions were handled in increasing order, redeliveries included
        out_of_order = {pk: versions for pk, versions in order.items() if any(a > b for a, b in pairwise(versions))}
        assert out_of_order == {}
        assert {pk: versions[-1] for pk, versions in order.items()} == final
        # And the run did exercise redeliveries and keys with several changes
        assert failures > 0
        assert sum(1 for versions in order.values() if len(set(versions)) > 1) >= 10
        assert host.terminate() == 0, host.log_tail()
    finally:
        host.stop_quietly()

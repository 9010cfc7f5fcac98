"""``dbfanout run`` with ``on_lost_position = "resnapshot"``: the host is down long enough for
PostgreSQL to invalidate its slot (``max_slot_wal_keep_size``, on a private server), rows change
meanwhile, and after the restart the poller recovers by itself while a writer keeps writing.

The whole pipeline: the poller → Service Bus emulator (duplicate detection) → the example handler
(processed-events helper, newest cursor per key) → a SQLite target, which must end equal to the
table: the rows changed while the slot was lost and every later change included.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from poller.sources.pg_logical.slot import LOST_SNAPSHOT_PREFIX
from poller.state.blob import open_state_store
from sbemulator import Emulator
from sbemulator.testing import unique_queue
from shared.models import Position
from shared.settings import StorageConnection
from tests.host.app_support import HostProcess, Target, pg_logical_app, wait_for
from tests.poller.lost_slot_support import LOSSY_SETTINGS, lose_slot, wal_status
from tests.poller.pg_logical_support import LogicalTable
from tests.support.azurite import Azurite
from tests.support.private_postgres import start_private_postgres

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def lossy_url() -> Iterator[str]:
    with start_private_postgres(LOSSY_SETTINGS) as pg:
        yield pg.url


class Writer(threading.Thread):
    """Updates and inserts rows (no deletes: a row deleted while the slot is lost cannot be re-delivered)."""

    def __init__(self, table: LogicalTable) -> None:
        super().__init__(daemon=True)
        self.table, self.stop, self.writes = table, threading.Event(), 0
        self.rng = random.Random(32)

    def run(self) -> None:
        while not self.stop.wait(0.02):  # a pace, not a wait for a condition
            if self.rng.random() < 0.7:
                self.table.sql(
                    "UPDATE {t} SET v = 'w' || n, n = n + 1 WHERE id = :k", params={"k": self.rng.randrange(150)}
                )
            else:
                self.table.sql("INSERT INTO {t} (id, v, n) VALUES (:k, 'new', 0) ON CONFLICT (id) DO NOTHING",
                               params={"k": 1000 + self.writes})  # fmt: skip
            self.writes += 1


def test_dbfanout_run_recovers_a_lost_slot_unattended_and_the_target_equals_the_source(
    tmp_path: Path, azurite: Azurite, servicebus: Emulator, lossy_url: str
) -> None:
    table = LogicalTable(lossy_url)
    table.create()
    cfg = table.config
    queue = unique_queue(servicebus, "lost", requires_duplicate_detection=True, lock_duration="PT30S")
    app = pg_logical_app(
        tmp_path / "app", queue=queue, storage=azurite.connection_string,
        servicebus=servicebus.connection_string, table=table,
        poller_toml='on_lost_position = "resnapshot"\nsnapshot_chunk_size = 50\nbatch_size = 50\n'
        "lease_ttl_seconds = 10\n",
    )  # fmt: skip
    store = open_state_store(
        StorageConnection(connection_string=azurite.connection_string), "db-state", app.app_name, "orders"
    )

    def checkpoint() -> Position | None:
        snap = store.load()
        return snap.doc.checkpoint.position if snap else None

    def source_rows() -> dict[int, dict[str, Any]]:
        with table.engine.connect() as conn:
            rows = conn.execute(sa.text(f"SELECT id, v, n FROM {table.name}")).all()
        return {r.id: {"id": r.id, "v": r.v, "n": r.n} for r in rows}

    target = Target(app.root / "target.db")
    host = HostProcess(app)
    writer = Writer(table)
    try:
        # Given a running app that delivered rows 0-99
        table.insert(range(100), "old")
        host.start()
        wait_for(lambda: len(target.rows()) == 100, 120, "the first 100 rows handled")
        # When the host is down, rows change, and PostgreSQL invalidates the slot
        host.kill()
        table.sql("UPDATE {t} SET v = 'gap' WHERE id < 20")
        table.insert(range(100, 150), "gap")
        lose_slot(table.engine, cfg.slot or "")
        # And the host comes back while a writer keeps writing
        host.start()
        writer.start()

        def recovered() -> bool:
            position = checkpoint()
            state = position.snapshot if position is not None else None
            return state is not None and state.id.startswith(LOST_SNAPSHOT_PREFIX) and not state.active

        wait_for(recovered, 300, "the resnapshot of the lost slot to finish")
        writer.stop.set()
        writer.join()
        table.sql("DELETE FROM {t} WHERE id = 50")  # a later delete streams from the new slot
        table.sql("INSERT INTO {t} (id, v, n) VALUES (-1, 'end', 0)")  # the last change to wait for
        expected = source_rows()

        def settled() -> bool:
            return -1 in target.rows() and servicebus.queue_stats(queue)["messages"] == 0

        wait_for(settled, 300, "the last change to be handled and the queue to drain")
        # Then the target equals the source: the gap's changes, the writer's and the later ones
        got = target.rows()
        stale = {k: (got.get(k), v) for k, v in expected.items() if got.get(k) != v}
        assert not stale and set(got) == set(expected), f"stale: {list(stale.items())[:5]}"
        assert writer.writes > 0 and wal_status(table.engine, cfg.slot or "") == "reserved"
        # And the host said what happened once, and never failed a timer over it
        log = host.log_text()
        assert log.count("was invalidated by PostgreSQL") == 1 and "replaced (it starts at" in log
        assert "timer function failed" not in log, host.log_tail()
    finally:
        writer.stop.set()
        host.stop_quietly()
        target.close()
        table.drop()

"""``dbfanout run`` with a pg_logical poller's initial snapshot, a writer on the chunk being read,
and the host SIGKILLed twice mid-snapshot: the target equals the source.

The whole pipeline: the poller (snapshot = "initial") → Service Bus emulator (duplicate detection)
→ the example handler (processed-events helper, newest cursor per key) → a SQLite target. The
writer reads the landed snapshot position from the state blob and updates and deletes the rows
just after it - the chunk the poller is reading - while other rows change elsewhere too.
Small by default; 100,000 rows with ``DBFANOUT_FULL_TESTS=1``.
"""

from __future__ import annotations

import random
import threading
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from poller.state.blob import open_state_store
from sbemulator import Emulator
from sbemulator.testing import unique_queue
from shared.models import SnapshotState
from shared.settings import StorageConnection
from tests.conftest import FULL
from tests.host.app_support import HostProcess, Target, pg_logical_app, wait_for
from tests.poller.pg_logical_support import LogicalTable, logical_table
from tests.support.azurite import Azurite

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROWS, CHUNK = (100_000, 1000) if FULL else (2000, 100)


class ChunkWriter(threading.Thread):
    """Updates and deletes rows of the chunk being read (just past the landed last key), and others."""

    def __init__(self, table: LogicalTable, position: Any) -> None:
        super().__init__(daemon=True)
        self.table, self.position, self.stop, self.writes = table, position, threading.Event(), 0
        self.rng = random.Random(25)

    def run(self) -> None:
        while not self.stop.wait(0.01):  # a pace, not a wait for a condition
            state = self.position()
            base = int(state.last_key["id"]) + 1 if state is not None and state.last_key else 0
            key = base + self.rng.randrange(CHUNK) if self.rng.random() < 0.7 else self.rng.randrange(ROWS + 100)
            statement = self.rng.choice(
                [
                    "UPDATE {t} SET v = 'w' || n, n = n + 1 WHERE id = :k",
                    "DELETE FROM {t} WHERE id = :k",
                    "INSERT INTO {t} (id, v, n) VALUES (:k, 'back', 0) ON CONFLICT (id) DO NOTHING",
                ]
            )
            self.table.sql(statement, params={"k": key})
            self.writes += 1


def test_a_snapshot_under_dbfanout_run_with_writes_on_its_chunk_and_two_kills_rebuilds_the_source(
    tmp_path: Path, azurite: Azurite, servicebus: Emulator, pg_logical_url: str
) -> None:
    with logical_table(pg_logical_url, slot=False) as table:
        # Given rows that predate the slot, and an app whose pg_logical poller snapshots them first
        with table.engine.begin() as conn:
            fill = f"INSERT INTO {table.name} (id, v, n) SELECT g, 'old', 0 FROM generate_series(0, :n) g"
            conn.execute(sa.text(fill), {"n": ROWS - 1})
        table.create_slot()
        cfg = table.config
        # Each high-watermark write takes 50 ms on the server: the writer's commits land between a
        # chunk's select and its watermark (the window DBLog's drop rule exists for) many times.
        slow = f"{table.name}_slow"
        table.sql(
            f"CREATE FUNCTION {slow}() RETURNS trigger LANGUAGE plpgsql AS $$"
            " BEGIN IF NEW.kind = 'watermark' THEN PERFORM pg_sleep(0.05); END IF; RETURN NEW; END $$",
            f"CREATE TRIGGER {slow} BEFORE INSERT OR UPDATE ON {cfg.signal_table}"
            f" FOR EACH ROW EXECUTE FUNCTION {slow}()",
        )
        queue = unique_queue(servicebus, "snap", requires_duplicate_detection=True, lock_duration="PT30S")
        app = pg_logical_app(
            tmp_path / "app", queue=queue, storage=azurite.connection_string,
            servicebus=servicebus.connection_string, table=table,
            poller_toml=f'snapshot = "initial"\nsnapshot_chunk_size = {CHUNK}\nbatch_size = {CHUNK}\n'
            "max_batches_per_tick = 20\nlease_ttl_seconds = 10\n",
        )  # fmt: skip
        store = open_state_store(
            StorageConnection(connection_string=azurite.connection_string), "db-state", app.app_name, "orders"
        )

        def position() -> SnapshotState | None:
            snap = store.load()
            return snap.doc.checkpoint.position.snapshot if snap and snap.doc.checkpoint.position else None

        target = Target(app.root / "target.db")
        host = HostProcess(app)
        writer = ChunkWriter(table, position)
        try:
            host.start()
            writer.start()
            # When the host is SIGKILLed twice while the snapshot runs (each time past a landed chunk)
            for kill in (1, 2):

                def landed(chunks: int = 2 * kill) -> bool:
                    state = position()
                    return state is not None and state.active and state.chunks >= chunks

                wait_for(landed, 300, f"snapshot chunks landed before kill {kill}")
                host.kill()
                host.start()

            def finished() -> bool:
                state = position()
                return state is not None and not state.active

            wait_for(finished, 600, "the snapshot to finish")
            writer.stop.set()
            writer.join()
            table.sql("INSERT INTO {t} (id, v, n) VALUES (-1, 'end', 0)")  # the last change to wait for

            def source_rows() -> dict[int, dict[str, Any]]:
                with table.engine.connect() as conn:
                    rows = conn.execute(sa.text(f"SELECT id, v, n FROM {table.name}")).all()
                return {r.id: {"id": r.id, "v": r.v, "n": r.n} for r in rows}

            expected = source_rows()

            def settled() -> bool:  # the last change handled and nothing left in the queue
                return -1 in target.rows() and servicebus.queue_stats(queue)["messages"] == 0

            wait_for(settled, 600, "the last change to be handled and the queue to drain")
            got = target.rows()
            stale = {k: (got.get(k), v) for k, v in expected.items() if got.get(k) != v}
            resurrected = sorted(set(got) - set(expected))
            assert not stale and not resurrected, f"stale: {list(stale.items())[:5]}, resurrected: {resurrected[:5]}"
            # Then the target equals the source, the writer wrote on the chunks being read, and the
            # processed-events helper absorbed the copies the kills caused
            assert writer.writes > 0 and host.starts == 3
            done = position()
            assert done is not None and done.rows > 0 and not done.cancelled
            print(f"rows={ROWS} writes={writer.writes} snapshot rows={done.rows} duplicates={target.duplicates()}")
        finally:
            writer.stop.set()
            host.stop_quietly()
            target.close()
            table.sql(f"DROP TABLE IF EXISTS {cfg.signal_table}", f"DROP FUNCTION IF EXISTS {slow}()")

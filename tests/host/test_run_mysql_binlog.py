"""``dbfanout run`` with a kind = "mysql_binlog" poller, a writer, and the host SIGKILLed once: the
target equals the source, hard deletes included; and the same with an initial snapshot, the writer
on the chunk being read.

The whole pipeline: MariaDB's binlog → the poller → Service Bus emulator (duplicate detection) →
the example handler (processed-events helper, newest cursor per key) → a SQLite target.
"""

from __future__ import annotations

import dataclasses
import random
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from poller.snapshot.mysql import mysql_signal_sql
from poller.state.blob import open_state_store
from sbemulator import Emulator
from sbemulator.testing import unique_queue
from shared.models import SnapshotState
from shared.settings import StorageConnection
from tests.conftest import FULL
from tests.host.app_support import AppDir, HostProcess, Target, wait_for
from tests.poller.mysql_binlog_support import BinlogTables, binlog_tables
from tests.support.azurite import Azurite

pytestmark = [pytest.mark.integration, pytest.mark.slow]

WRITES = 5000 if FULL else 300


class Writer(threading.Thread):
    """Inserts, updates, deletes and re-inserts random rows, a few per transaction."""

    def __init__(self, engine: sa.Engine, table: str) -> None:
        super().__init__(daemon=True)
        self.engine, self.table, self.rng, self.done = engine, table, random.Random(30), 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while self.done < WRITES:
                with self.engine.begin() as conn:
                    for _ in range(self.rng.randrange(1, 6)):
                        key = self.rng.randrange(60)
                        statement = self.rng.choice([
                            f"INSERT INTO {self.table} (id, v, n) VALUES (:k, 'new', 0)"
                            " ON DUPLICATE KEY UPDATE n = n + 1",
                            f"UPDATE {self.table} SET v = CONCAT('u', n), n = n + 1 WHERE id = :k",
                            f"DELETE FROM {self.table} WHERE id = :k",
                        ])  # fmt: skip
                        conn.execute(sa.text(statement), {"k": key})
                        self.done += 1
        except BaseException as exc:  # surfaced by the test
            self.error = exc


def binlog_app(
    tmp_path: Path, azurite: Azurite, servicebus: Emulator, tables: BinlogTables, prefix: str, settings: str
) -> tuple[AppDir, str, Any]:
    """A ``dbfanout run`` app whose poller ``orders`` reads ``tables``' first table from the binlog
    into a fresh queue (``settings``: more TOML lines of the poller); the app, the queue, its state store."""
    queue = unique_queue(servicebus, prefix, requires_duplicate_detection=True, lock_duration="PT30S")
    app = AppDir.create(
        tmp_path / "app", queue=queue, storage=azurite.connection_string,
        servicebus=servicebus.connection_string, source_url=tables.url,
    )  # fmt: skip
    (app.root / "dbfanout.toml").write_text(
        f'[app]\nname = "{app.app_name}"\n\n[pollers.orders]\nkind = "mysql_binlog"\n'
        f'source_url = "${{ORDERS_DB_URL}}"\ntables = ["{tables.name}"]\n{settings}'
        f'lease_ttl_seconds = 10\nschedule = "*/1 * * * * *"\n'
        f'queue = "{queue}"\nhandler = "handlers.example:handle"\n'
    )
    store = open_state_store(
        StorageConnection(connection_string=azurite.connection_string), "db-state", app.app_name, "orders"
    )
    return app, queue, store


def end_and_settle(
    tables: BinlogTables, target: Target, servicebus: Emulator, queue: str, timeout: float
) -> dict[int, dict[str, Any]]:
    """Write the last change to wait for (id -1), wait until it is handled and the queue is empty,
    and give the source's rows then (what the target must equal)."""
    tables.sql("INSERT INTO {t} (id, v, n) VALUES (-1, 'end', 0)")
    with tables.engine.connect() as conn:
        rows = conn.execute(sa.text(f"SELECT id, v, n FROM {tables.name}")).all()
    expected = {r.id: {"id": r.id, "v": r.v, "n": r.n} for r in rows}

    def settled() -> bool:  # the last change handled and nothing left in the queue
        return -1 in target.rows() and servicebus.queue_stats(queue)["messages"] == 0

    wait_for(settled, timeout, "the last change to be handled and the queue to drain")
    return expected


def test_a_binlog_poller_under_dbfanout_run_with_a_kill_rebuilds_the_source(
    tmp_path: Path, azurite: Azurite, servicebus: Emulator, mysql_binlog_url: str
) -> None:
    with binlog_tables(mysql_binlog_url) as tables:
        app, queue, store = binlog_app(
            tmp_path, azurite, servicebus, tables, "binlog", "batch_size = 50\nmax_batches_per_tick = 20\n"
        )

        def checkpointed() -> bool:
            snap = store.load()
            return snap is not None and snap.doc.checkpoint.position is not None

        target, host = Target(app.root / "target.db"), HostProcess(app)
        writer = Writer(tables.engine, tables.name)
        try:
            # Given a running host whose poller has taken its starting point in the binlog
            host.start()
            wait_for(checkpointed, 120, "the poller's first checkpoint")
            # When a writer inserts, updates and deletes while the host is SIGKILLed once
            writer.start()
            wait_for(lambda: writer.done > WRITES // 2 or not writer.is_alive(), 120, "half the writes")
            host.kill()
            host.start()
            writer.join(300)
            assert writer.error is None, writer.error
            expected = end_and_settle(tables, target, servicebus, queue, 300)
            # Then the target equals the source: every delete applied, nothing resurrected
            got = target.rows()
            assert got == expected, host.log_tail()
            assert host.starts == 2
        finally:
            host.stop_quietly()
            target.close()


SNAPSHOT_ROWS, CHUNK = (50_000, 1000) if FULL else (2000, 100)


class ChunkWriter(threading.Thread):
    """Updates, deletes and re-inserts rows of the chunk being read (just past the landed last key), and others."""

    def __init__(self, engine: sa.Engine, table: str, position: Callable[[], SnapshotState | None]) -> None:
        super().__init__(daemon=True)
        self.engine, self.table, self.position = engine, table, position
        self.rng, self.stop, self.writes = random.Random(25), threading.Event(), 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while not self.stop.wait(0.01):  # a pace, not a wait for a condition
                state = self.position()
                base = int(state.last_key["id"]) + 1 if state is not None and state.last_key else 0
                near = self.rng.random() < 0.7
                key = base + self.rng.randrange(CHUNK) if near else self.rng.randrange(SNAPSHOT_ROWS + 100)
                statement = self.rng.choice([
                    f"UPDATE {self.table} SET v = CONCAT('w', n), n = n + 1 WHERE id = :k",
                    f"DELETE FROM {self.table} WHERE id = :k",
                    f"INSERT INTO {self.table} (id, v, n) VALUES (:k, 'back', 0) ON DUPLICATE KEY UPDATE n = n + 1",
                ])  # fmt: skip
                with self.engine.begin() as conn:
                    conn.execute(sa.text(statement), {"k": key})
                self.writes += 1
        except BaseException as exc:  # surfaced by the test
            self.error = exc


def test_an_initial_snapshot_under_dbfanout_run_with_writes_on_its_chunk_and_a_kill_rebuilds_the_source(
    tmp_path: Path, azurite: Azurite, servicebus: Emulator, mysql_binlog_url: str
) -> None:
    with binlog_tables(mysql_binlog_url) as tables:
        # Given rows that exist before the poller's first tick, and an app whose binlog poller
        # snapshots them first (its signal table created as `validate --fix` does)
        with tables.engine.begin() as conn:
            conn.execute(sa.text(f"INSERT INTO {tables.name} (id, v, n) VALUES (:i, 'old', 0)"),
                         [{"i": i} for i in range(SNAPSHOT_ROWS)])  # fmt: skip
        signal = f"{tables.name}_sig"
        config = dataclasses.replace(tables.config, signal_table=f"{tables.database}.{signal}")
        with tables.engine.begin() as conn:
            for statement in mysql_signal_sql(config):
                conn.execute(sa.text(statement))
        queue = unique_queue(servicebus, "binsnap", requires_duplicate_detection=True, lock_duration="PT30S")
        app = AppDir.create(
            tmp_path / "app", queue=queue, storage=azurite.connection_string,
            servicebus=servicebus.connection_string, source_url=tables.url,
        )  # fmt: skip
        (app.root / "dbfanout.toml").write_text(
            f'[app]\nname = "{app.app_name}"\n\n[pollers.orders]\nkind = "mysql_binlog"\n'
            f'source_url = "${{ORDERS_DB_URL}}"\ntables = ["{tables.name}"]\nsignal_table = "{signal}"\n'
            f'snapshot = "initial"\nsnapshot_chunk_size = {CHUNK}\nbatch_size = {CHUNK}\n'
            f'max_batches_per_tick = 20\nlease_ttl_seconds = 10\nschedule = "*/1 * * * * *"\n'
            f'queue = "{queue}"\nhandler = "handlers.example:handle"\n'
        )
        store = open_state_store(
            StorageConnection(connection_string=azurite.connection_string), "db-state", app.app_name, "orders"
        )

        def position() -> SnapshotState | None:
            snap = store.load()
            return snap.doc.checkpoint.position.snapshot if snap and snap.doc.checkpoint.position else None

        target, host = Target(app.root / "target.db"), HostProcess(app)
        writer = ChunkWriter(tables.engine, tables.name, position)
        try:
            host.start()
            writer.start()

            # When the host is SIGKILLed once while the snapshot runs (past a landed chunk)
            def landed() -> bool:
                state = position()
                return state is not None and (state.chunks >= 2 or not state.active)

            wait_for(landed, 300, "snapshot chunks landed before the kill")
            host.kill()
            host.start()

            def finished() -> bool:
                state = position()
                return state is not None and not state.active

            wait_for(finished, 600, "the snapshot to finish")
            writer.stop.set()
            writer.join()
            assert writer.error is None, writer.error
            expected = end_and_settle(tables, target, servicebus, queue, 600)
            # Then the target equals the source: no row stale, none resurrected
            got = target.rows()
            stale = {k: (got.get(k), v) for k, v in expected.items() if got.get(k) != v}
            resurrected = sorted(set(got) - set(expected))
            assert not stale and not resurrected, f"stale: {list(stale.items())[:5]}, resurrected: {resurrected[:5]}"
            done = position()
            assert writer.writes > 0 and host.starts == 2
            assert done is not None and done.rows > 0 and done.error is None and not done.cancelled
        finally:
            host.stop_quietly()
            target.close()
            with tables.engine.begin() as conn:
                conn.execute(sa.text(f"DROP TABLE IF EXISTS {signal}"))

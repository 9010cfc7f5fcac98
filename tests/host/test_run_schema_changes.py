"""``dbfanout run`` while the source table is migrated under it (issue 32), on SQLite, PostgreSQL and MariaDB.

A writer thread inserts, updates and soft-deletes rows and, between its transactions, migrates the
table: ADD COLUMN (nullable), ADD COLUMN with a DEFAULT, RENAME COLUMN, a type change (int -> bigint,
varchar -> text; SQLite: the table rebuild) and DROP COLUMN. The poller runs in the real host the
whole time. At the end the target equals the source, and every event carried the table's shape of
the moment it was read (never an older one than its row's write).

A rename of the cursor column stops delivery with an error naming the column and the runbook, shown
by ``dbfanout status``, the checkpoint held; the runbook (point the cursor setting at the new
name, adopt the fingerprint) resumes delivery with nothing lost.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from sbemulator import Emulator
from sbemulator.testing import unique_queue
from tests.conftest import FULL
from tests.host.app_support import AppDir, HostProcess, Target, drop_pg_schema, pg_schema_url, sqlite_engine, wait_for
from tests.poller.pg_logical_support import LogicalTable
from tests.support.azurite import Azurite
from tests.support.databases import MYSQL_URL, PG_URL, unique_name, unreachable_reason

pytestmark = pytest.mark.integration

PROBE = Path(__file__).with_name("schema_probe.py")
ROWS = 2_000 if FULL else 300
BIG = 2**40
RUNBOOK = "docs/operations.md#schema-changes-migrations"

COLUMNS = "id INTEGER PRIMARY KEY, version INTEGER NOT NULL, payload VARCHAR(40), n INTEGER, deleted_at VARCHAR(40)"


def _index(t: str) -> str:
    return f"CREATE INDEX ix_{t}_keyset ON {t} (version, id)"


# The column names of a row after each migration (index = migrations applied so far).
SHAPES = [
    {"id", "version", "payload", "n", "deleted_at"},
    {"id", "version", "payload", "n", "deleted_at", "extra"},
    {"id", "version", "payload", "n", "deleted_at", "extra", "flag"},
    {"id", "version", "note", "n", "deleted_at", "extra", "flag"},
    {"id", "version", "note", "n", "deleted_at", "extra", "flag"},  # retyped: n BIGINT, note TEXT
    {"id", "version", "note", "n", "deleted_at", "flag"},
]
RETYPED = 4  # after this many migrations, n holds BIG + version and the text outgrows VARCHAR(40)


def _retype(dialect: str, t: str) -> list[str]:
    if dialect == "postgresql":
        return [f"ALTER TABLE {t} ALTER COLUMN n TYPE BIGINT, ALTER COLUMN note TYPE TEXT"]
    if dialect in ("mysql", "mariadb"):
        return [f"ALTER TABLE {t} MODIFY COLUMN n BIGINT, MODIFY COLUMN note TEXT"]
    columns = "id, version, note, n, deleted_at, extra, flag"
    return [  # SQLite cannot retype a column: the documented table rebuild, in one transaction
        f"CREATE TABLE {t}_new (id INTEGER PRIMARY KEY, version INTEGER NOT NULL, note TEXT, n BIGINT,"
        " deleted_at VARCHAR(40), extra VARCHAR(20), flag INTEGER NOT NULL DEFAULT 7)",
        f"INSERT INTO {t}_new ({columns}) SELECT {columns} FROM {t}",
        f"DROP TABLE {t}",
        f"ALTER TABLE {t}_new RENAME TO {t}",
        _index(t),
    ]


def _migrations(dialect: str, t: str) -> list[list[str]]:
    return [
        [f"ALTER TABLE {t} ADD COLUMN extra VARCHAR(20)"],
        [f"ALTER TABLE {t} ADD COLUMN flag INTEGER NOT NULL DEFAULT 7"],
        [f"ALTER TABLE {t} RENAME COLUMN payload TO note"],
        _retype(dialect, t),
        [f"ALTER TABLE {t} DROP COLUMN extra"],
    ]


class MigratingWriter:
    """Writes a table (``orders``) from a thread in small transactions and migrates it between them.

    ``version`` counts the writes; ``n`` is the version too (plus BIG once retyped). Deletes are soft
    (``deleted_at``) unless ``hard_deletes``.
    """

    def __init__(
        self,
        url: str,
        rows: int,
        *,
        per_txn: int = 5,
        pause: float = 0.05,
        before_migration: Callable[[int], None],
        table: str = "orders",
        hard_deletes: bool = False,
    ) -> None:
        self.engine = sqlite_engine(url)
        self.dialect = self.engine.dialect.name
        self.table, self.hard_deletes = table, hard_deletes
        if table == "orders":
            with self.engine.begin() as conn:
                conn.exec_driver_sql(f"CREATE TABLE orders ({COLUMNS})")
                conn.exec_driver_sql(_index("orders"))
        self.rows, self.per_txn, self.pause = rows, per_txn, pause
        self.rng = random.Random(11)
        self.version = 0
        self.live: list[int] = []
        self.migrated_at: list[int] = []  # the version written last before each migration
        self.before_migration = before_migration  # called with that version; returns when it may go ahead
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="migrating-writer", daemon=True)

    def start(self) -> MigratingWriter:
        self._thread.start()
        return self

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError("the writer did not finish")
        if self.error is not None:
            raise self.error

    def _run(self) -> None:
        try:
            migrations = _migrations(self.dialect, self.table)
            every = self.rows // (len(migrations) + 1)
            next_id = 1
            while next_id <= self.rows:
                with self.engine.begin() as conn:
                    for _ in range(self.per_txn):
                        next_id = self._one(conn, next_id)
                due = min(next_id // every, len(migrations))
                while len(self.migrated_at) < due:
                    self._migrate(migrations[len(self.migrated_at)])
                time.sleep(self.pause)
            self.touch_all()
        except BaseException as exc:  # surfaced by join()
            self.error = exc

    def _migrate(self, statements: list[str]) -> None:
        self.before_migration(self.version)
        if self.dialect == "sqlite":  # pysqlite does not open a transaction for DDL: BEGIN it ourselves
            raw = self.engine.raw_connection()
            driver: Any = raw.driver_connection
            legacy, driver.isolation_level = driver.isolation_level, None
            try:
                cursor = raw.cursor()
                cursor.execute("BEGIN IMMEDIATE")
                for statement in statements:
                    cursor.execute(statement)
                cursor.execute("COMMIT")
            finally:
                driver.isolation_level = legacy  # the pooled connection goes back as it came
                raw.close()
        else:
            with self.engine.begin() as conn:
                for statement in statements:
                    conn.exec_driver_sql(statement)
        self.migrated_at.append(self.version)

    def _values(self) -> dict[str, Any]:
        """The columns a write sets now (they follow the migrations) and their values."""
        phase = len(self.migrated_at)
        values: dict[str, Any] = {
            "version": self.version,
            "note" if phase >= 3 else "payload": ("x" * 60 if phase >= RETYPED else "") + f"v{self.version}",
            "n": self.version + (BIG if phase >= RETYPED else 0),
        }
        if phase in (1, 2, 3, 4):  # extra exists from the first migration to the last
            values["extra"] = f"e{self.version}"
        return values

    def _update(self, conn: sa.Connection, i: int) -> None:
        values = self._values()
        sets = ", ".join(f"{c} = :{c}" for c in values)
        conn.execute(sa.text(f"UPDATE {self.table} SET {sets} WHERE id = :id"), {**values, "id": i})

    def _one(self, conn: sa.Connection, next_id: int) -> int:
        self.version += 1
        roll = self.rng.random()
        t = self.table
        if roll < 0.25 and self.live:
            self._update(conn, self.rng.choice(self.live))
            return next_id
        if roll < 0.35 and self.live:
            i = self.live.pop(self.rng.randrange(len(self.live)))
            delete = f"DELETE FROM {t}" if self.hard_deletes else f"UPDATE {t} SET version = :v, deleted_at = 'gone'"
            conn.execute(sa.text(f"{delete} WHERE id = :i"), {"v": self.version, "i": i})
            return next_id
        values = {"id": next_id, **self._values()}  # one statement: a log-based source sees each one
        conn.execute(sa.text(f"INSERT INTO {t} ({', '.join(values)}) VALUES (:{', :'.join(values)})"), values)
        self.live.append(next_id)
        return next_id + 1

    def touch_all(self) -> None:
        """Write every live row once more, so each one's last event is in the final shape."""
        with self.engine.begin() as conn:
            for i in sorted(self.live):
                self.version += 1
                self._update(conn, i)

    def expected(self) -> dict[int, dict[str, Any]]:
        with self.engine.connect() as conn:
            rows = conn.execute(sa.text(f"SELECT * FROM {self.table} WHERE deleted_at IS NULL")).mappings().all()
        return {int(r["id"]): dict(r) for r in rows}


@pytest.fixture(params=["sqlite", "postgresql", "mariadb"])
def db_url(request: pytest.FixtureRequest) -> Iterator[str | None]:
    """None: SQLite files in the app folder; else a PostgreSQL schema or a MariaDB database of its own."""
    if request.param == "sqlite":
        yield None
        return
    base = PG_URL if request.param == "postgresql" else MYSQL_URL
    reason = unreachable_reason(base)
    if reason:
        pytest.skip(reason)
    name = unique_name("mig")
    if request.param == "postgresql":
        url = pg_schema_url(base, name)
        try:
            yield url
        finally:
            drop_pg_schema(base, name)
        return
    admin = sa.create_engine(base)
    with admin.begin() as conn:
        conn.exec_driver_sql(f"CREATE DATABASE {name}")
    try:
        yield str(sa.make_url(base).set(database=name).render_as_string(hide_password=False))
    finally:
        with admin.begin() as conn:
            conn.exec_driver_sql(f"DROP DATABASE IF EXISTS {name}")
        admin.dispose()


def _app(tmp_path: Path, azurite: Azurite, servicebus: Emulator, db_url: str | None) -> AppDir:
    queue = unique_queue(
        servicebus, "orders", requires_duplicate_detection=True, max_delivery_count=10, lock_duration="PT30S"
    )
    app = AppDir.create(
        tmp_path / "app",
        queue=queue,
        storage=azurite.connection_string,
        servicebus=servicebus.connection_string,
        source_url=db_url,
        target_url=db_url,
        handler="schema_probe:handle",
    )
    shutil.copy(PROBE, app.root / "schema_probe.py")
    return app


def _events(app: AppDir) -> list[dict[str, Any]]:
    """The events the probe handler saw that carry a row (a hard delete carries none)."""
    path = app.root / "events.jsonl"
    events = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return [e for e in events if e["version"] is not None]


def _delivered_up_to(app: AppDir) -> Callable[[int], None]:
    def wait(version: int) -> None:
        """Each migration lands under a poller whose plan was made for the shape before it."""
        wait_for(lambda: max((e["version"] for e in _events(app)), default=0) >= version, 60, f"version {version}")

    return wait


def _check_shapes(events: list[dict[str, Any]], migrated_at: list[int]) -> None:
    """Every event carried the table's shape at or after its row's write (never an older one), the
    new column in every later event, the retyped values exact; each phase was delivered."""
    seen_phases = set()
    for event in events:
        phase = sum(1 for at in migrated_at if event["version"] > at)
        seen_phases.add(phase)
        assert set(event["columns"]) in SHAPES[phase:], (event, migrated_at)
        if event["op"] == "upsert":
            assert event["n"] == event["version"] + (BIG if phase >= RETYPED else 0), event
    assert seen_phases == set(range(len(SHAPES))), seen_phases
    last = [e for e in events if e["version"] > migrated_at[-1]]
    assert last and all(set(e["columns"]) == SHAPES[-1] for e in last)


def _converged(writer: MigratingWriter, target: Target) -> Callable[[], bool]:
    return lambda: target.rows() == writer.expected()


def _cli(app: AppDir, *args: str) -> subprocess.CompletedProcess[str]:
    """A dbfanout command run the way an operator runs it in the app folder (local.settings.json)."""
    env = {k: v for k, v in os.environ.items() if k not in app.settings}
    return subprocess.run(
        [sys.executable, "-m", "dbfanout.cli", *args],
        cwd=app.root,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_run_follows_add_rename_retype_and_drop_column_while_a_writer_writes(
    tmp_path: Path, azurite: Azurite, servicebus: Emulator, db_url: str | None
) -> None:
    # Given a running app streaming the orders table
    app = _app(tmp_path, azurite, servicebus, db_url)
    writer = MigratingWriter(
        db_url or f"sqlite:///{app.root / 'source.db'}", ROWS, before_migration=_delivered_up_to(app)
    )
    target = Target(db_url or app.root / "target.db")
    host = HostProcess(app).start()
    try:
        # When a writer writes while it migrates the table five times, the host streaming throughout
        wait_for(host.started, 60, "the host to start")
        writer.start()
        writer.join(300)
        # Then the target converges to the source, nothing lost, every row in its final shape
        wait_for(_converged(writer, target), 180, "the target to match the source")
        assert target.rows() == writer.expected()
        assert len(writer.migrated_at) == len(SHAPES) - 1
        # And every event carried the table's shape of the moment it was read
        _check_shapes(_events(app), writer.migrated_at)
        # And no tick failed on a column the plan still named
        log = host.log_text()
        for failure in ("does not exist", "Unknown column", "no such column", "SchemaChangeError"):
            assert failure not in log, host.log_tail(80)
        assert host.terminate() == 0, host.log_tail()
    finally:
        host.stop_quietly()
        target.close()


def _checkpoint(app: AppDir) -> Any:
    status = json.loads(_cli(app, "status", "orders", "--json").stdout)
    return status, status[0]["checkpoint"]["cursor"] if "checkpoint" in status[0] else None


def test_a_renamed_cursor_column_stops_delivery_with_the_runbook_in_status_until_the_operator_follows_it(
    tmp_path: Path, azurite: Azurite, servicebus: Emulator
) -> None:
    # Given a running app that delivered the table
    app = _app(tmp_path, azurite, servicebus, None)
    writer = MigratingWriter(f"sqlite:///{app.root / 'source.db'}", 0, before_migration=lambda version: None)
    target = Target(app.root / "target.db")
    with writer.engine.begin() as conn:
        for i in range(1, 21):
            conn.execute(sa.text("INSERT INTO orders (id, version, payload, n) VALUES (:i, :i, 'p', :i)"), {"i": i})
    host = HostProcess(app, "--log-level", "DEBUG").start()  # DEBUG: each failing tick
    try:
        wait_for(_converged(writer, target), 120, "the first rows to arrive")
        # When a migration renames the cursor column, and rows are written after it
        with writer.engine.begin() as conn:
            conn.exec_driver_sql("ALTER TABLE orders RENAME COLUMN version TO revision")
            for i in range(21, 31):
                conn.execute(
                    sa.text("INSERT INTO orders (id, revision, payload, n) VALUES (:i, :i, 'p', :i)"), {"i": i}
                )
        # Then the poller stops with an error naming the column and the runbook (never a silent stall)
        wait_for(lambda: "'version'" in host.log_text() and RUNBOOK in host.log_text(), 60, "the error in the log")
        # And `dbfanout status` shows it, the checkpoint held where it was over the failing ticks that follow
        status, held = _checkpoint(app)
        assert RUNBOOK in status[0]["source_error"] and "'version'" in status[0]["source_error"], status
        failures = host.log_text().count("still: ")
        wait_for(lambda: host.log_text().count("still: ") >= failures + 2, 60, "two more failing ticks")
        assert _checkpoint(app)[1] == held
        # And it was said once at ERROR, without a traceback, not once per tick (the ticks after it at DEBUG)
        errors = [line for line in host.log_text().splitlines() if " ERROR " in line and RUNBOOK in line]
        assert len(errors) == 1 and "Traceback" not in host.log_text(), host.log_tail(40)
        assert len(target.rows()) == 20
        # When the operator follows the runbook: point the cursor at the new name, adopt the fingerprint
        assert host.terminate() == 0, host.log_tail()
        toml = app.root / "dbfanout.toml"
        toml.write_text(toml.read_text().replace('cursor = "version"', 'cursor = "revision"'))
        reset = _cli(app, "checkpoint", "reset", "orders", "--accept-fingerprint", "--yes")
        assert reset.returncode == 0, reset.stdout + reset.stderr
        host.start()
        # Then delivery resumes from the held position: the rows written after the rename arrive
        wait_for(lambda: len(target.rows()) == 30, 120, "the rows written after the rename")
        assert _checkpoint(app)[0][0].get("source_error") is None
        assert host.terminate() == 0, host.log_tail()
    finally:
        host.stop_quietly()
        target.close()


def test_a_pg_logical_poller_under_run_follows_add_rename_retype_and_drop_column(
    tmp_path: Path, azurite: Azurite, servicebus: Emulator, pg_logical_url: str
) -> None:
    # Given a running app whose pg_logical poller streams a published table
    table = LogicalTable(pg_logical_url)
    try:
        table.create(COLUMNS)
        cfg = table.config
        app = _app(tmp_path, azurite, servicebus, None)
        (app.root / "dbfanout.toml").write_text(
            f'[app]\nname = "{app.app_name}"\n\n[pollers.orders]\nkind = "pg_logical"\n'
            f'source_url = "{pg_logical_url}"\ntables = ["{table.name}"]\nslot = "{cfg.slot}"\n'
            f'publication = "{cfg.publication}"\nsignal_table = "{cfg.signal_table}"\n'
            f'batch_size = 100\nmax_batches_per_tick = 20\nlease_ttl_seconds = 10\nschedule = "*/1 * * * * *"\n'
            f'queue = "{app.queue}"\nhandler = "schema_probe:handle"\n'
        )
        writer = MigratingWriter(
            pg_logical_url, ROWS, before_migration=_delivered_up_to(app), table=table.name, hard_deletes=True
        )
        target = Target(app.root / "target.db")
        host = HostProcess(app).start()
        try:
            # When a writer writes (real deletes) while it migrates the table five times
            wait_for(host.started, 60, "the host to start")
            writer.start()
            writer.join(300)
            # Then the target converges to the source and every event carried the shape of its decoding
            wait_for(_converged(writer, target), 180, "the target to match the source")
            assert len(writer.migrated_at) == len(SHAPES) - 1
            _check_shapes(_events(app), writer.migrated_at)
            assert host.terminate() == 0, host.log_tail()
        finally:
            host.stop_quietly()
            target.close()
    finally:
        table.drop()

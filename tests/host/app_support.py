"""End-to-end support: a deployable app folder, the host as a subprocess, a source writer.

The app folder mirrors a deployment: ``function_app.py``, ``host.json`` and ``handlers/`` copied
from the repository, plus the test's ``dbfanout.toml`` and ``local.settings.json``. The
dbfanout packages come from the environment, as ``requirements.txt`` provides them on Azure.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from dbfanout.demo.appdir import app_settings, write_app_folder
from dbfanout.demo.appdir import sqlite_engine as wal_sqlite_engine
from shared.codec import loads
from tests.support.ports import wait_until

REPO = Path(__file__).resolve().parents[2]
SOURCE_DDL = (
    "CREATE TABLE orders (id INTEGER PRIMARY KEY, version INTEGER NOT NULL, v VARCHAR(40),"
    " committed_at FLOAT, deleted_at VARCHAR(40))"
)


def wait_for(condition: Callable[[], object], timeout: float, what: str, interval: float = 0.25) -> None:
    """Poll ``condition`` until it holds; TimeoutError naming ``what`` otherwise (host tests poll gently)."""
    wait_until(condition, timeout, what, interval)


def sqlite_engine(path: Path | str) -> sa.Engine:
    """An engine on a WAL-mode SQLite file (readers and the writer do not block each other), or on a URL."""
    if isinstance(path, str) and not path.startswith("sqlite"):
        return sa.create_engine(path)
    return wal_sqlite_engine(path)


def pg_schema_url(base: str, schema: str) -> str:
    """``base`` with its search_path set to ``schema`` (created here), isolating a test's tables."""
    engine = sa.create_engine(base)
    with engine.begin() as conn:
        conn.exec_driver_sql(f"CREATE SCHEMA {schema}")
    engine.dispose()
    sep = "&" if "?" in base else "?"
    return f"{base}{sep}options=-csearch_path%3D{schema}"


def drop_pg_schema(base: str, schema: str) -> None:
    engine = sa.create_engine(base)
    with engine.begin() as conn:
        conn.exec_driver_sql(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
    engine.dispose()


@dataclass
class AppDir:
    """A Functions app folder for one test."""

    root: Path
    queue: str
    settings: dict[str, str]
    app_name: str = field(default_factory=lambda: "e2e" + uuid.uuid4().hex[:8])

    @classmethod
    def create(
        cls,
        root: Path,
        *,
        queue: str,
        storage: str,
        servicebus: str,
        schedule: str = "*/1 * * * * *",
        batch_size: int = 100,
        host_json: dict[str, Any] | None = None,
        source_url: str | None = None,
        target_url: str | None = None,
        transport: str = "servicebus",
        queues_json: dict[str, Any] | None = None,
        handler: str = "handlers.example:handle",
        poller_toml: str = "",
        subscriptions: Mapping[str, Mapping[str, str | int]] | None = None,
    ) -> AppDir:
        """``poller_toml``: more ``key = value`` lines for the poller's section. ``subscriptions``
        (name → its keys, ``handler`` included) make the poller a topic poller: ``queue`` is then
        the topic's name."""
        settings = app_settings(
            root, storage=storage, servicebus=servicebus, source_url=source_url, target_url=target_url
        )
        write_app_folder(root, settings)
        doc = json.loads((root / "host.json").read_text())
        if host_json:
            doc["extensions"]["serviceBus"].update(host_json)
        if queues_json:
            doc["extensions"].setdefault("queues", {}).update(queues_json)
        (root / "host.json").write_text(json.dumps(doc, indent=2))
        app = cls(root, queue, settings)
        (root / "dbfanout.toml").write_text(
            f"""
[app]
name = "{app.app_name}"

[pollers.orders]
source_url = "${{ORDERS_DB_URL}}"
table = "orders"
cursor = "version"
pk = ["id"]
{"topic" if subscriptions else "queue"} = "{queue}"
schedule = "{schedule}"
batch_size = {batch_size}
max_batches_per_tick = 50
lease_ttl_seconds = 10
settle_seconds = 0
soft_delete_column = "deleted_at"
{"" if subscriptions else f'handler = "{handler}"'}
transport = "{transport}"
{poller_toml}
{_subscription_tables(subscriptions or {})}
"""
        )
        if target_url is None:
            sqlite_engine(root / "target.db").dispose()  # WAL before the handler creates its tables
        return app


def pg_logical_app(root: Path, *, queue: str, storage: str, servicebus: str, table: Any, poller_toml: str) -> AppDir:
    """An app folder whose one poller ``orders`` is ``kind = "pg_logical"`` over ``table`` (a
    :class:`tests.poller.pg_logical_support.LogicalTable`), delivering to ``queue`` with the example
    handler, on a 1 s schedule. ``poller_toml``: its other keys (batch size, lease, snapshot, ...)."""
    app = AppDir.create(root, queue=queue, storage=storage, servicebus=servicebus, source_url=table.url)
    cfg = table.config
    (root / "dbfanout.toml").write_text(
        f'[app]\nname = "{app.app_name}"\n\n[pollers.orders]\nkind = "pg_logical"\n'
        f'source_url = "${{ORDERS_DB_URL}}"\ntables = ["{table.name}"]\nslot = "{cfg.slot}"\n'
        f'publication = "{cfg.publication}"\nsignal_table = "{cfg.signal_table}"\n{poller_toml}'
        f'schedule = "*/1 * * * * *"\nqueue = "{queue}"\nhandler = "handlers.example:handle"\n'
    )
    return app


def _subscription_tables(subscriptions: Mapping[str, Mapping[str, str | int]]) -> str:
    """``[pollers.orders.subscriptions.NAME]`` tables (JSON strings and integers are TOML values)."""
    return "\n".join(
        f"[pollers.orders.subscriptions.{name}]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in keys.items())
        for name, keys in subscriptions.items()
    )


class HostProcess:
    """``python -m dbfanout.cli run --app-root DIR`` as a child process, logs in a file."""

    def __init__(self, app: AppDir, *extra_args: str) -> None:
        self.app = app
        self.extra_args = extra_args
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self) -> HostProcess:
        env = {k: v for k, v in os.environ.items() if k not in self.app.settings}  # local.settings.json decides
        env["PYTHONUNBUFFERED"] = "1"
        log = (self.app.root / "host.log").open("ab")
        log.write(f"---- start {self.starts}\n".encode())
        log.flush()
        cmd = [sys.executable, "-m", "dbfanout.cli", "run", "--app-root", str(self.app.root), *self.extra_args]
        self.proc = subprocess.Popen(cmd, cwd=self.app.root, env=env, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        self.starts += 1
        return self

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def terminate(self, timeout: float = 60.0) -> int:
        """SIGTERM, then wait for the graceful exit; returns the exit code."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop_quietly(self) -> None:
        if self.alive():
            assert self.proc is not None
            self.proc.kill()
            self.proc.wait(10)

    def log_text(self) -> str:
        path = self.app.root / "host.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def started(self) -> bool:
        """Whether the current process logged that its triggers are running."""
        return "host started" in self.log_text().rpartition(f"---- start {self.starts - 1}\n")[2]

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])


class SourceWriter:
    """Inserts, updates and soft-deletes rows of ``orders`` from a thread, in small transactions."""

    def __init__(self, path: Path | str, rows: int, *, seed: int = 7, per_txn: int = 20, pause: float = 0.02) -> None:
        self.engine = sqlite_engine(path)
        with self.engine.begin() as conn:
            conn.exec_driver_sql(SOURCE_DDL)
            conn.exec_driver_sql("CREATE INDEX ix_orders_keyset ON orders (version, id)")
        self.rows = rows
        self.rng = random.Random(seed)
        self.per_txn = per_txn
        self.pause = pause
        self.version = 0
        self.live: list[int] = []
        self.ops = {"insert": 0, "update": 0, "delete": 0}
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="source-writer", daemon=True)

    def start(self) -> SourceWriter:
        self._thread.start()
        return self

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError("the source writer did not finish")
        if self.error is not None:
            raise self.error

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    def _run(self) -> None:
        try:
            next_id = 1
            while next_id <= self.rows:
                with self.engine.begin() as conn:
                    for _ in range(self.per_txn):
                        next_id = self._one(conn, next_id)
                time.sleep(self.pause)
        except BaseException as exc:  # surfaced by join()
            self.error = exc

    def _one(self, conn: sa.Connection, next_id: int) -> int:
        self.version += 1
        roll = self.rng.random()
        now = time.time()
        if roll < 0.25 and self.live:
            i = self.rng.choice(self.live)
            conn.execute(
                sa.text("UPDATE orders SET version = :ver, v = :v, committed_at = :t WHERE id = :i"),
                {"ver": self.version, "v": f"u{self.version}", "t": now, "i": i},
            )
            self.ops["update"] += 1
            return next_id
        if roll < 0.35 and self.live:
            i = self.live.pop(self.rng.randrange(len(self.live)))
            conn.execute(
                sa.text("UPDATE orders SET version = :ver, deleted_at = 'gone', committed_at = :t WHERE id = :i"),
                {"ver": self.version, "t": now, "i": i},
            )
            self.ops["delete"] += 1
            return next_id
        if next_id > self.rows:
            return next_id
        conn.execute(
            sa.text("INSERT INTO orders (id, version, v, committed_at) VALUES (:i, :ver, :v, :t)"),
            {"i": next_id, "ver": self.version, "v": f"i{self.version}", "t": now},
        )
        self.live.append(next_id)
        self.ops["insert"] += 1
        return next_id + 1

    def expected(self) -> dict[int, dict[str, Any]]:
        """What the target must hold: every live source row, column for column."""
        with self.engine.connect() as conn:
            rows = conn.execute(sa.text("SELECT * FROM orders WHERE deleted_at IS NULL")).mappings().all()
        return {int(r["id"]): dict(r) for r in rows}

    def total_rows(self) -> int:
        with self.engine.connect() as conn:
            return int(conn.execute(sa.text("SELECT count(*) FROM orders")).scalar_one())


class Target:
    """Reads what the example handler wrote."""

    def __init__(self, path: Path | str) -> None:
        url = path if isinstance(path, str) else f"sqlite:///{path}"
        self.engine = sa.create_engine(url, connect_args={"timeout": 30} if url.startswith("sqlite") else {})

    def _has(self, table: str) -> bool:
        return sa.inspect(self.engine).has_table(table)

    def _count(self, table: str) -> int:
        if not self._has(table):
            return 0
        with self.engine.connect() as conn:
            return int(conn.execute(sa.text(f"SELECT count(*) FROM {table}")).scalar_one())

    def rows(self) -> dict[int, dict[str, Any]]:
        if not self._has("dbfanout_example_target"):
            return {}
        with self.engine.connect() as conn:
            found = conn.execute(sa.text("SELECT pk, row FROM dbfanout_example_target")).all()
        return {int(loads(pk)["id"]): loads(row) for pk, row in found}

    def processed(self) -> int:
        return self._count("dbfanout_processed_events")

    def duplicates(self) -> int:
        return self._count("dbfanout_example_duplicates")

    def close(self) -> None:
        self.engine.dispose()

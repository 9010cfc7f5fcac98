"""bench_capacity.py's ``--source mysql_binlog``: a MariaDB database of its own, its table and app config.

The shared test server runs with the binlog off and must not be reconfigured: when ``--mysql-url``
has no row-based binlog, a private ``mariadbd`` with it on is started for the configuration
(tests/support/private_mariadb.py) and stopped with it.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Callable
from pathlib import Path

import sqlalchemy as sa

from poller.state.blob import open_state_store
from shared.settings import StorageConnection
from tests.support.private_mariadb import binlog_reason, start_private_mariadb

BINLOG_CONFIG = """
[app]
name = "{name}"

[pollers.orders]
kind = "mysql_binlog"
source_url = "${{ORDERS_DB_URL}}"
tables = ["{table}"]
queue = "{queue}"
schedule = "*/1 * * * * *"
batch_size = {batch}
max_batches_per_tick = {max_batches}
lease_ttl_seconds = 60
handler = "bench_handler:handle"
{more}
"""


def _cpu_seconds(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class MariaDbCost:
    """A database of its own on a MariaDB server that writes a row-based binlog, and that server's CPU.

    MariaDB runs every connection as a thread of one process, so the poller's and the writer's
    shares cannot be told apart as PostgreSQL's backends can: ``cpu_now`` reports the whole server
    (application name ``"server"``), and nothing when its process is not on this machine.
    """

    def __init__(self, base_url: str, undo: contextlib.ExitStack) -> None:
        self.pid: int | None = None
        if binlog_reason(base_url) is None:
            self.pid = _server_pid(base_url)
        else:
            server = start_private_mariadb()
            undo.callback(server.stop)
            base_url, self.pid = server.url, server.process.pid
        self.name = f"bench_cap_{uuid.uuid4().hex[:8]}"
        self._admin = sa.create_engine(base_url)
        with self._admin.begin() as conn:
            conn.exec_driver_sql(f"CREATE DATABASE {self.name}")
        self.url = sa.engine.make_url(base_url).set(database=self.name).render_as_string(hide_password=False)

    def cpu_now(self) -> dict[int, tuple[str, float]]:
        """The server process's CPU seconds since it started, now."""
        return {self.pid: ("server", _cpu_seconds(self.pid))} if self.pid else {}

    def drop(self) -> None:
        with self._admin.begin() as conn:
            conn.exec_driver_sql(f"DROP DATABASE IF EXISTS {self.name}")
        self._admin.dispose()


def _server_pid(url: str) -> int | None:
    """The server's process id when it runs on this machine and its pid file is readable."""
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            pid_file = conn.exec_driver_sql("SELECT @@pid_file").scalar()
        return int(Path(str(pid_file)).read_text().strip())
    except (OSError, ValueError, sa.exc.SQLAlchemyError):
        return None
    finally:
        engine.dispose()


def binlog_table(url: str) -> sa.Engine:
    """Create the writer's table (bench_latency's columns) in the database; returns the writer's engine."""
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        conn.exec_driver_sql(
            "CREATE TABLE orders (id INT PRIMARY KEY, version INT NOT NULL, v TEXT, committed_at DOUBLE)"
        )
    return engine


def checkpointed(storage: str, app_name: str) -> Callable[[], bool]:
    """Whether the poller has taken its starting point in the binlog (rows committed before it are
    never read, so the warm-up waits for it)."""
    store = open_state_store(StorageConnection(connection_string=storage), "db-state", app_name, "orders")

    def taken() -> bool:
        snap = store.load()
        return snap is not None and snap.doc.checkpoint.position is not None

    return taken

"""``dbfanout run`` with a kind = "mysql_binlog" poller while XA transactions commit, roll back and
commit in one phase among plain writes, the host SIGKILLed once: the target equals the source.

MariaDB writes an XA transaction's rows at ``XA PREPARE``; a poller that delivered them then (or
ignored ``XA ROLLBACK``) leaves rolled-back values and rows in the target. The whole pipeline:
MariaDB's binlog → the poller → Service Bus emulator → the example handler → a SQLite target.
"""

from __future__ import annotations

import random
import threading
from pathlib import Path

import pytest
import sqlalchemy as sa

from sbemulator import Emulator
from tests.conftest import FULL
from tests.host.app_support import HostProcess, Target, wait_for
from tests.host.test_run_mysql_binlog import Writer, binlog_app, end_and_settle
from tests.poller.mysql_binlog_support import binlog_tables
from tests.support.azurite import Azurite

pytestmark = [pytest.mark.integration, pytest.mark.slow]

XA_WRITES = 600 if FULL else 120
XA_KEYS = range(100, 140)  # rows of their own (plain writes use 0..59): only record locks, no waits on them


class XaWriter(threading.Thread):
    """XA transactions on keys of their own: an update and an insert each, then XA COMMIT (half),
    XA ROLLBACK (a quarter) or XA COMMIT ONE PHASE (a quarter)."""

    def __init__(self, engine: sa.Engine, table: str) -> None:
        super().__init__(daemon=True)
        self.engine, self.table, self.rng, self.done = engine, table, random.Random(42), 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with self.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
                while self.done < XA_WRITES:
                    self._one(conn, f"xa{self.done}")
                    self.done += 1
        except BaseException as exc:  # surfaced by the test
            self.error = exc

    def _one(self, conn: sa.Connection, xid: str) -> None:
        key, fate = self.rng.choice(XA_KEYS), self.rng.random()
        conn.exec_driver_sql(f"XA START '{xid}'")
        conn.execute(sa.text(f"UPDATE {self.table} SET v = :v, n = n + 1 WHERE id = :k"), {"v": xid, "k": key})
        conn.execute(
            sa.text(f"INSERT INTO {self.table} (id, v, n) VALUES (:k, :v, 0)"), {"k": 1000 + self.done, "v": xid}
        )
        conn.exec_driver_sql(f"XA END '{xid}'")
        if fate < 0.25:
            conn.exec_driver_sql(f"XA COMMIT '{xid}' ONE PHASE")
            return
        conn.exec_driver_sql(f"XA PREPARE '{xid}'")
        conn.exec_driver_sql(f"XA ROLLBACK '{xid}'" if fate < 0.5 else f"XA COMMIT '{xid}'")


def test_xa_transactions_under_dbfanout_run_with_a_kill_rebuild_the_source(
    tmp_path: Path, azurite: Azurite, servicebus: Emulator, mysql_binlog_url: str
) -> None:
    with binlog_tables(mysql_binlog_url) as tables:
        app, queue, store = binlog_app(
            tmp_path, azurite, servicebus, tables, "binlogxa", "batch_size = 50\nmax_batches_per_tick = 20\n"
        )

        def checkpointed() -> bool:
            snap = store.load()
            return snap is not None and snap.doc.checkpoint.position is not None

        target, host = Target(app.root / "target.db"), HostProcess(app)
        writer, xa = Writer(tables.engine, tables.name), XaWriter(tables.engine, tables.name)
        try:
            # Given a running host whose poller has taken its starting point in the binlog
            host.start()
            wait_for(checkpointed, 120, "the poller's first checkpoint")
            tables.insert(list(XA_KEYS), "seed")  # the XA transactions' own rows
            # When XA transactions commit, roll back and commit in one phase among plain writes,
            # and the host is SIGKILLed once meanwhile
            writer.start()
            xa.start()
            wait_for(lambda: xa.done > XA_WRITES // 2 or not xa.is_alive(), 120, "half the XA transactions")
            host.kill()
            host.start()
            xa.join(300)
            writer.join(300)
            assert xa.error is None and writer.error is None, (xa.error, writer.error)
            expected = end_and_settle(tables, target, servicebus, queue, 300)
            # Then the target equals the source: no rolled-back value or row, every committed one
            got = target.rows()
            assert got == expected, host.log_tail()
            rolled_back = [k for k in range(1000, 1000 + XA_WRITES) if k not in expected]
            assert rolled_back and not set(rolled_back) & set(got)
        finally:
            host.stop_quietly()
            target.close()

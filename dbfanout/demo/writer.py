"""The demo's source writer: inserts, updates and soft deletes on ``orders`` at a steady rate.

One thread, small transactions every ~50 ms. It is the only writer, and it assigns the
``version`` cursor itself, so versions become visible in order (see ``appdir.CONFIG_TEMPLATE``).
With ``outbox=True`` deletes are hard deletes, and every change also writes its outbox row (the
row as it now is) in the same transaction: the ``--source outbox`` demo. ``hard_deletes=True`` on
a PostgreSQL engine is the ``--source pg-logical`` demo (a replication slot sees every change), on
a MariaDB/MySQL engine the ``--source mysql-binlog`` demo (the binlog does).
"""

from __future__ import annotations

import bisect
import datetime as dt
import random
import threading
import time
from pathlib import Path

import sqlalchemy as sa

from dbfanout.demo.appdir import sqlite_engine
from dbfanout.demo.handler import POISON_STATUS
from poller.sources.mysql_binlog.position import file_number
from shared.outbox import write_change

__all__ = ["SourceWriter"]

CUSTOMERS = ("ada", "grace", "linus", "margaret", "ken", "barbara", "dennis", "frances")
STATUSES = ("new", "paid", "packed", "shipped")
MAX_OPS_PER_TXN = 200  # catch up after a stall in bounded transactions
MIN_LIVE = 20  # below this many live rows, only insert (updates and deletes need targets)
TICK = 0.05


def _now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="microseconds")


class SourceWriter:
    """Writes changes from a thread; ``stop()`` ends it, counters say what it wrote."""

    def __init__(
        self,
        source: Path | sa.Engine,
        rate: float,
        *,
        seed: int | None = None,
        outbox: bool = False,
        hard_deletes: bool = False,
    ) -> None:
        self.engine = source if isinstance(source, sa.Engine) else sqlite_engine(source)
        self.outbox = outbox
        self.hard_deletes = hard_deletes or outbox
        # PostgreSQL: (WAL insert position just before each commit, last version of that transaction),
        # so a replication-slot checkpoint (a commit LSN) maps back to the versions it covers.
        self._lsn_marks: list[tuple[int, int]] | None = [] if self.engine.dialect.name == "postgresql" else None
        # MariaDB/MySQL: ((binlog file number, offset) just before each commit, the version before that
        # transaction, its last version): a binlog checkpoint (a transaction's start and a row index in
        # it) maps back to the versions it covers.
        binlog = self.engine.dialect.name in ("mysql", "mariadb")
        self._binlog_marks: list[tuple[tuple[int, int], int, int]] | None = [] if binlog else None
        self.rate = rate
        self.rng = random.Random(seed)
        self.ops = {"insert": 0, "update": 0, "delete": 0}
        self.version = 0
        self.poison_id: int | None = None
        self.error: BaseException | None = None
        self._next_id = 1
        self._live: list[int] = []
        self._written_at: list[float] = []  # monotonic time of each version (index = version - 1)
        self._poison_requested = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="demo-source-writer", daemon=True)

    @property
    def written(self) -> int:
        return sum(self.ops.values())

    def start(self) -> SourceWriter:
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Stop writing and wait for the last transaction; re-raises a writer error."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        self.engine.dispose()
        if self.error is not None:
            raise self.error

    def inject_poison(self) -> None:
        """Ask for one poison row in the next transaction (``poison_id`` is set once written)."""
        self._poison_requested.set()

    def seconds_behind(self, version: int) -> float:
        """How long ago the first change after ``version`` was written (0 when none is pending)."""
        if version >= self.version:
            return 0.0
        return max(0.0, time.monotonic() - self._written_at[max(version, 0)])

    def version_at_lsn(self, lsn: int) -> int:
        """The last version whose transaction committed at or before the commit LSN ``lsn`` (PostgreSQL)."""
        marks = self._lsn_marks or []
        at = bisect.bisect_right(marks, (lsn, self.version + 1))
        return marks[at - 1][1] if at else 0

    def version_at_binlog(self, txn_start: tuple[int, int], seq: int) -> int:
        """The last version a binlog checkpoint covers: ``txn_start`` (file number, offset) is its
        transaction's start and ``seq`` its last row delivered there (-1: none; the position is
        between transactions, and every transaction that started before it is covered)."""
        marks = self._binlog_marks or []
        if seq < 0:
            at = bisect.bisect_left(marks, txn_start, key=lambda m: m[0])
            return marks[at - 1][2] if at else 0
        # The transaction holding the checkpoint is the last one whose mark is at or before its start;
        # its rows are its versions in order (one row change per version).
        at = bisect.bisect_right(marks, txn_start, key=lambda m: m[0])
        if not at:
            return 0
        _, before, last = marks[at - 1]
        return min(before + seq + 1, last)

    def _run(self) -> None:
        started = time.monotonic()
        try:
            while not self._stop.is_set():
                due = int(self.rate * (time.monotonic() - started)) - self.written
                if due > 0 or self._poison_requested.is_set():
                    before = self.version
                    with self.engine.begin() as conn:
                        if self._poison_requested.is_set():
                            self._poison(conn)
                        for _ in range(min(due, MAX_OPS_PER_TXN)):
                            self._one(conn)
                        self._mark_lsn(conn)
                        self._mark_binlog(conn, before)
                self._stop.wait(TICK)
        except BaseException as exc:  # surfaced by stop()
            self.error = exc

    def _mark_lsn(self, conn: sa.Connection) -> None:
        if self._lsn_marks is not None:  # the commit record comes after this position
            lsn = conn.execute(sa.text("SELECT pg_current_wal_insert_lsn() - '0/0'::pg_lsn")).scalar_one()
            self._lsn_marks.append((int(lsn), self.version))

    def _mark_binlog(self, conn: sa.Connection, before: int) -> None:
        if self._binlog_marks is not None:  # the transaction is written at or after this binlog position
            try:
                row = conn.execute(sa.text("SHOW MASTER STATUS")).one()
            except sa.exc.ProgrammingError:  # MySQL 8.4 renamed it (an error does not end a MySQL transaction)
                row = conn.execute(sa.text("SHOW BINARY LOG STATUS")).one()
            self._binlog_marks.append(((file_number(str(row[0])), int(row[1])), before, self.version))

    def _bump(self) -> int:
        self.version += 1
        self._written_at.append(time.monotonic())
        return self.version

    def _one(self, conn: sa.Connection) -> None:
        roll = self.rng.random()
        if len(self._live) >= MIN_LIVE and roll < 0.30:
            self._update(conn)
        elif len(self._live) >= MIN_LIVE and roll < 0.42:
            self._delete(conn)
        else:
            self._live.append(self._insert(conn))

    def _insert(self, conn: sa.Connection, status: str | None = None) -> int:
        row_id = self._next_id
        self._next_id += 1
        conn.execute(
            sa.text(
                "INSERT INTO orders (id, version, updated_at, customer, amount, status)"
                " VALUES (:id, :version, :at, :customer, :amount, :status)"
            ),
            {
                "id": row_id,
                "version": self._bump(),
                "at": _now(),
                "customer": self.rng.choice(CUSTOMERS),
                "amount": round(self.rng.uniform(1, 500), 2),
                "status": status or STATUSES[0],
            },
        )
        self._record(conn, row_id, "insert")
        self.ops["insert"] += 1
        return row_id

    def _update(self, conn: sa.Connection) -> None:
        row_id = self.rng.choice(self._live)
        conn.execute(
            sa.text("UPDATE orders SET version = :version, updated_at = :at, amount = :amount, status = :status"
                    " WHERE id = :id"),
            {"id": row_id, "version": self._bump(), "at": _now(), "amount": round(self.rng.uniform(1, 500), 2),
             "status": self.rng.choice(STATUSES)},
        )  # fmt: skip
        self._record(conn, row_id, "update")
        self.ops["update"] += 1

    def _delete(self, conn: sa.Connection) -> None:
        row_id = self._live.pop(self.rng.randrange(len(self._live)))
        if self.outbox:  # a hard delete: only the outbox row tells the poller
            conn.execute(sa.text("DELETE FROM orders WHERE id = :id"), {"id": row_id})
            write_change(conn, aggregate=row_id, type="delete", payload={"id": row_id, "version": self._bump()})
        elif self.hard_deletes:  # a replication slot sees the delete itself
            conn.execute(sa.text("DELETE FROM orders WHERE id = :id"), {"id": row_id})
            self._bump()
        else:  # a soft delete: the poller only sees deletions it can read (deleted_at set, new version)
            at = _now()
            conn.execute(
                sa.text("UPDATE orders SET version = :version, updated_at = :at, deleted_at = :at WHERE id = :id"),
                {"id": row_id, "version": self._bump(), "at": at},
            )
        self.ops["delete"] += 1

    def _record(self, conn: sa.Connection, row_id: int, change: str) -> None:
        """The outbox row of a change: the row as it is now, in the change's transaction."""
        if self.outbox:
            row = conn.execute(sa.text("SELECT * FROM orders WHERE id = :id"), {"id": row_id}).mappings().one()
            write_change(conn, aggregate=row_id, type=change, payload=dict(row))

    def _poison(self, conn: sa.Connection) -> None:
        # Kept out of the live list: later updates would be new poison events after the fix.
        self.poison_id = self._insert(conn, status=POISON_STATUS)
        self._poison_requested.clear()

"""Idempotency helpers for handlers writing to a SQL database.

Delivery is at-least-once, so a handler may see an event twice (see the failure windows in
the operations guide). Record each event id in a ``processed_events`` table **in the same
transaction** as the side effect: a duplicate then finds its id already there and is skipped,
and a crash rolls both back together.

    processed = ProcessedEvents(engine)              # creates the table if needed
    def handle(events, context):
        with engine.begin() as conn:
            for event in processed.fresh(conn, events):
                conn.execute(upsert(...))            # the side effect, same transaction

Works on SQLite, PostgreSQL and MariaDB/MySQL (insert-or-ignore per dialect).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable

import sqlalchemy as sa
from sqlalchemy.dialects import mysql, postgresql, sqlite

from shared.models import RowChange
from shared.telemetry import metrics

__all__ = ["ProcessedEvents"]


class ProcessedEvents:
    """A table of handled event ids with a primary key on ``event_id``."""

    def __init__(self, engine: sa.Engine, table: str = "dbfanout_processed_events", *, create: bool = True) -> None:
        self._engine = engine
        self.table = sa.Table(
            table,
            sa.MetaData(),
            sa.Column("event_id", sa.String(64), primary_key=True),
            sa.Column("poller", sa.String(64), nullable=False),
            sa.Column("processed_at", sa.DateTime(timezone=True), nullable=False),
        )
        if create:
            self.table.create(engine, checkfirst=True)

    def _insert_ignoring_duplicates(self, dialect: str) -> sa.Insert:
        if dialect == "postgresql":
            # RETURNING, not rowcount: psycopg 3 reports -1 for a skipped-or-not single insert here.
            stmt = postgresql.insert(self.table).on_conflict_do_nothing(index_elements=["event_id"])
            return stmt.returning(self.table.c.event_id)
        if dialect == "sqlite":
            stmt_lite = sqlite.insert(self.table).on_conflict_do_nothing(index_elements=["event_id"])
            return stmt_lite.returning(self.table.c.event_id)
        if dialect in ("mysql", "mariadb"):
            return mysql.insert(self.table).prefix_with("IGNORE")
        raise NotImplementedError(f"ProcessedEvents does not support the {dialect} dialect yet")

    def fresh(self, conn: sa.Connection, events: Iterable[RowChange]) -> list[RowChange]:
        """Record the events' ids and return those not seen before (call inside a transaction).

        PostgreSQL and SQLite record a whole batch in one multi-row statement (RETURNING names the
        ids it inserted; SQLAlchemy pages it under the driver's parameter limit); MariaDB/MySQL,
        whose INSERT IGNORE cannot say which rows it skipped, one statement per event. An id
        repeated within ``events`` is fresh once, at its first place.
        """
        events = list(events)
        if not events:
            return []
        fresh = self._fresh(conn, events)
        if len(fresh) < len(events):  # redeliveries this table absorbed
            metrics.duplicates_absorbed.add(len(events) - len(fresh), {"poller": events[0].poller})
        return fresh

    def _fresh(self, conn: sa.Connection, events: list[RowChange]) -> list[RowChange]:
        stmt = self._insert_ignoring_duplicates(conn.dialect.name)
        now = dt.datetime.now(dt.UTC)
        rows = [{"event_id": e.event_id, "poller": e.poller, "processed_at": now} for e in events]
        fresh: list[RowChange] = []
        if conn.dialect.name in ("postgresql", "sqlite") and conn.dialect.insert_executemany_returning:
            inserted = {row[0] for row in conn.execute(stmt, rows)}
            for event in events:
                if event.event_id in inserted:
                    inserted.discard(event.event_id)  # a repeat later in the batch is a duplicate
                    fresh.append(event)
            return fresh
        for event, row in zip(events, rows, strict=True):
            result = conn.execute(stmt, row)
            if result.first() is not None if result.returns_rows else result.rowcount == 1:
                fresh.append(event)
        return fresh

    def count(self) -> int:
        with self._engine.connect() as conn:
            return int(conn.execute(sa.select(sa.func.count()).select_from(self.table)).scalar_one())

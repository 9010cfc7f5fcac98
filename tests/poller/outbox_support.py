"""Helpers for the outbox source tests: an outbox table per test, and a poller config for it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import sqlalchemy as sa

from poller.ports import SourceRow
from poller.tick.lifecycle import run_tick
from shared.config import PollerConfig
from shared.models import Position
from shared.outbox import create_outbox, write_change
from tests.poller.tick_support import RecordingSink
from tests.support.databases import unique_name
from tests.support.ports import wait_until


def outbox_poller(url: str, table: str, **changes: Any) -> PollerConfig:
    values: dict[str, Any] = {
        "name": "changes",
        "source_url": url,
        "cursor": "id",
        "pk": ("id",),
        "queue": "changes",
        "table": table,
        "kind": "outbox",
        "batch_size": 10,
        "max_batches_per_tick": 100,
        "lease_ttl_seconds": 30,
        "settle_seconds": 0.0,
    }
    values.update(changes)
    return PollerConfig(**values)


class Outbox:
    """A fresh outbox table (dropped by :meth:`drop`), written like an application would."""

    def __init__(self, url: str, name: str | None = None) -> None:
        self.engine = sa.create_engine(url)
        self.name = name or unique_name("outbox")
        with self.engine.begin() as conn:
            create_outbox(conn, self.name)

    def write(self, aggregate: str, change: str, payload: Mapping[str, Any] | None = None) -> None:
        """One change in its own transaction."""
        with self.engine.begin() as conn:
            write_change(conn, self.name, aggregate=aggregate, type=change, payload=payload)

    def settled(self, timeout: float = 120) -> Outbox:
        """PostgreSQL: wait until every row written so far is below the transaction-id horizon.

        The horizon is the cluster's: another session's open transaction (other test runs share
        the server) holds every newer row back until it ends. Elsewhere: nothing to wait for.
        """
        if self.engine.dialect.name == "postgresql":
            query = sa.text(f"SELECT count(*) FROM {self.name} WHERE txid >= pg_snapshot_xmin(pg_current_snapshot())")

            def below() -> bool:
                with self.engine.connect() as conn:
                    return conn.execute(query).scalar() == 0

            wait_until(below, timeout, "the outbox rows to fall below the xid horizon")
        return self

    def begin(self) -> sa.Connection:
        conn = self.engine.connect()
        conn.begin()
        return conn

    def ids(self) -> list[int]:
        with self.engine.connect() as conn:
            return [r[0] for r in conn.execute(sa.text(f"SELECT id FROM {self.name} ORDER BY id"))]

    def drop(self) -> None:
        with self.engine.begin() as conn:
            conn.exec_driver_sql(f"DROP TABLE {self.name}")
        self.engine.dispose()


def changes(sink: RecordingSink) -> list[tuple[Any, ...]]:
    """What the handler would see, in order: (aggregate, change, op, after)."""
    return [(e.pk["aggregate"], e.change, e.op, dict(e.after or {})) for b in sink.accepted for e in b.events]


def tick_until_caught_up(poller: PollerConfig, source: Any, store: Any, sink: RecordingSink, ticks: int = 50) -> None:
    for _ in range(ticks):
        if run_tick(poller, source, store, sink, owner_id="owner-a").stop_reason == "caught_up":
            return
    raise AssertionError("the outbox poller did not catch up")


def read_until(source: Any, after: Position | None, want: int, timeout: float = 120) -> list[SourceRow]:
    """Fetch (as the timer would) until ``want`` rows arrived: the PostgreSQL horizon may lag."""
    rows: list[SourceRow] = []
    position = [after]

    def enough() -> bool:
        page = source.fetch(position[0], 100)
        rows.extend(page.rows)
        position[0] = page.last or position[0]
        return len(rows) >= want

    wait_until(enough, timeout, f"{want} outbox rows")
    return rows

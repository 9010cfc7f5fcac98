"""Helpers for the outbox source tests: an outbox table per test, and a poller config for it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import sqlalchemy as sa

from poller.tick import run_tick
from shared.config import PollerConfig
from shared.outbox import create_outbox, write_change
from tests.poller.tick_support import RecordingSink
from tests.support.databases import unique_name


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

"""Helpers for the pg_logical tests: a table with its own publication and slot, always dropped.

The server is shared (max_replication_slots is small and other runs create slots too): every
name is unique, and the slot and the publication are dropped even when the test fails.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import pytest
import sqlalchemy as sa

from poller.sources.pg_logical.source import setup_sql
from shared.config import PollerConfig, parse_config
from shared.models import Batch, Lsn, RowChange
from tests.support.databases import unique_name


def logical_reason(url: str) -> str | None:
    """Why logical decoding cannot be tested on ``url`` (None: it can)."""
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            level = conn.execute(sa.text("SHOW wal_level")).scalar()
    finally:
        engine.dispose()
    if level != "logical":
        return f"the PostgreSQL at the test URL has wal_level = {level}, not logical"
    return None


class LogicalTable:
    """``id INTEGER PRIMARY KEY, v TEXT, n INTEGER``, published, with a pgoutput slot."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.name = unique_name("lg")
        self.engine = sa.create_engine(url)
        self.config = poller_config(url, self.name)

    def create(self, ddl: str = "id INTEGER PRIMARY KEY, v TEXT, n INTEGER", *, slot: bool = True) -> None:
        with self.engine.begin() as conn:
            conn.execute(sa.text(f"CREATE TABLE {self.name} ({ddl})"))
        for statement in setup_sql(self.config) if slot else ():  # a slot is created in a transaction of its own
            with self.engine.begin() as conn:
                conn.execute(sa.text(statement))

    def drop_slot(self) -> None:
        """Drop the slot and the publication (rows written next predate the slot made by create_slot)."""
        with self.engine.begin() as conn:
            conn.execute(
                sa.text("SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = :s"),
                {"s": self.config.slot},
            )
            conn.execute(sa.text(f"DROP PUBLICATION IF EXISTS {self.config.publication}"))

    def create_slot(self) -> None:
        for statement in setup_sql(self.config):  # a slot is created in a transaction of its own
            with self.engine.begin() as conn:
                conn.execute(sa.text(statement))

    def sql(self, *statements: str, params: dict[str, Any] | None = None) -> None:
        """Run the statements in ONE transaction."""
        with self.engine.begin() as conn:
            for statement in statements:
                conn.execute(sa.text(statement.format(t=self.name)), params or {})

    def insert(self, ids: Iterable[int], v: str = "x") -> None:
        rows = [{"id": i, "v": v, "n": 0} for i in ids]
        with self.engine.begin() as conn:
            conn.execute(sa.text(f"INSERT INTO {self.name} (id, v, n) VALUES (:id, :v, :n)"), rows)

    def confirmed_flush(self) -> Lsn:
        with self.engine.connect() as conn:
            text = conn.execute(
                sa.text("SELECT CAST(confirmed_flush_lsn AS text) FROM pg_replication_slots WHERE slot_name = :s"),
                {"s": self.config.slot},
            ).scalar_one()
        return Lsn.parse(text)

    def drop(self) -> None:
        with self.engine.begin() as conn:
            conn.execute(
                sa.text("SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = :s"),
                {"s": self.config.slot},
            )
            conn.execute(sa.text(f"DROP PUBLICATION IF EXISTS {self.config.publication}"))
            conn.execute(sa.text(f"DROP TABLE IF EXISTS {self.name}"))
            conn.execute(sa.text(f"DROP TABLE IF EXISTS {self.config.signal_table}"))
        self.engine.dispose()


def poller_config(url: str, table: str, **more: Any) -> PollerConfig:
    """Through the real config parser: what a dbfanout.toml with kind = "pg_logical" gives."""
    raw: dict[str, Any] = {
        "kind": "pg_logical",
        "source_url": url,
        "tables": [table],
        "slot": table,
        "publication": table,
        "signal_table": f"{table}_signal",  # the tests' own (the default one is shared)
        "queue": "changes",
        "batch_size": 50,
        "max_batches_per_tick": 20,
        "lease_ttl_seconds": 30,
        **more,
    }
    return parse_config({"app": {"name": "t"}, "pollers": {"p": raw}}, {}).pollers["p"]


@contextmanager
def logical_table(pg_url: str, *, slot: bool = True) -> Iterator[LogicalTable]:
    """A fresh table with its publication and slot (``slot=False``: neither); skips unless
    wal_level = logical; always drops all three."""
    reason = logical_reason(pg_url)
    if reason:
        pytest.skip(reason)
    table = LogicalTable(pg_url)
    try:
        table.create(slot=slot)
        yield table
    finally:
        table.drop()


def events_of(batches: Sequence[Batch]) -> list[RowChange]:
    """Every event, de-duplicated by event id as the queue's duplicate detection would (first wins)."""
    seen: set[str] = set()
    out: list[RowChange] = []
    for batch in batches:
        for event in batch.events:
            if event.event_id not in seen:
                seen.add(event.event_id)
                out.append(event)
    return out


def summary(events: Iterable[RowChange]) -> list[tuple[str | None, int, Any]]:
    """(change, id, v) per event: what a handler sees, in order."""
    return [(e.change, e.pk["id"], (e.after or {}).get("v")) for e in events]

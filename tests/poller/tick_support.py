"""Helpers for tick tests: a source table, a recording sink with faults, and a drain loop."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

import sqlalchemy as sa

from poller.ports import Source, StateStore
from poller.tick.lifecycle import TickResult, run_tick
from shared.config import PollerConfig
from shared.errors import EnqueueError
from shared.models import Batch

TABLE_DDL = "CREATE TABLE {t} (id INTEGER PRIMARY KEY, version BIGINT NOT NULL, v VARCHAR(40), deleted_at VARCHAR(40))"


def make_poller(url: str, table: str = "orders", **changes: object) -> PollerConfig:
    base = PollerConfig(
        name="orders",
        source_url=url,
        cursor="version",
        pk=("id",),
        queue="orders-changes",
        table=table,
        batch_size=10,
        max_batches_per_tick=100,
        lease_ttl_seconds=30,
        settle_seconds=0,
        soft_delete_column="deleted_at",
    )
    return replace(base, **changes)  # type: ignore[arg-type]


class SourceTable:
    """A table with an integer version cursor, written through a plain engine."""

    def __init__(self, url: str, table: str = "orders") -> None:
        self.engine = sa.create_engine(url)
        self.table = table
        self.version = 0
        with self.engine.begin() as conn:
            conn.execute(sa.text(f"DROP TABLE IF EXISTS {table}"))
            conn.execute(sa.text(TABLE_DDL.format(t=table)))
            conn.execute(sa.text(f"CREATE INDEX ix_{table}_keyset ON {table} (version, id)"))

    def upsert(self, ids: Iterable[int], value: str = "x", *, same_version: bool = False) -> None:
        with self.engine.begin() as conn:
            for i in ids:
                if not same_version:
                    self.version += 1
                conn.execute(sa.text(f"DELETE FROM {self.table} WHERE id = :i"), {"i": i})
                conn.execute(
                    sa.text(f"INSERT INTO {self.table} (id, version, v) VALUES (:i, :ver, :v)"),
                    {"i": i, "ver": self.version, "v": value},
                )

    def soft_delete(self, i: int) -> None:
        self.version += 1
        with self.engine.begin() as conn:
            conn.execute(
                sa.text(f"UPDATE {self.table} SET deleted_at = 'now', version = :ver WHERE id = :i"),
                {"i": i, "ver": self.version},
            )

    def states(self) -> set[tuple[int, int]]:
        """Every current (id, version): what must reach the sink."""
        with self.engine.connect() as conn:
            return {(r[0], r[1]) for r in conn.execute(sa.text(f"SELECT id, version FROM {self.table}"))}


class Crash(BaseException):
    """Stands for the process dying at this point (not an Exception: nothing may catch it)."""


@dataclass
class RecordingSink:
    """Accepts batches and remembers them; faults fire on the next sends."""

    accepted: list[Batch] = field(default_factory=list)
    fail_next: int = 0
    crash_next: int = 0
    before_accept: Callable[[Batch], None] | None = None

    def send(self, batch: Batch) -> None:
        if self.crash_next:
            self.crash_next -= 1
            raise Crash("process died mid-send")
        if self.fail_next:
            self.fail_next -= 1
            raise EnqueueError("broker refused the batch (injected)")
        if self.before_accept is not None:
            self.before_accept(batch)
        self.accepted.append(batch)

    def close(self) -> None:
        pass

    def delivered(self) -> list[tuple[int, int]]:
        return [(e.pk["id"], e.cursor) for b in self.accepted for e in b.events]  # type: ignore[misc]


def drain(
    poller: PollerConfig,
    source: Source,
    store: StateStore,
    sink: RecordingSink,
    *,
    owner_id: str = "owner-a",
    clock: Callable[[], dt.datetime] | None = None,
    max_ticks: int = 50,
) -> list[TickResult]:
    """Tick until caught up (errors propagate)."""
    results: list[TickResult] = []
    for _ in range(max_ticks):
        kwargs = {"clock": clock} if clock else {}
        result = run_tick(poller, source, store, sink, owner_id=owner_id, **kwargs)  # type: ignore[arg-type]
        results.append(result)
        if result.stop_reason in ("caught_up", "lease_held", "lease_lost"):
            return results
    raise AssertionError("did not catch up")

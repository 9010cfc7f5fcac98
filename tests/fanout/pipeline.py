"""A real pipeline in one process: SQLite source → tick → queue (either transport) → worker → SQLite target."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from poller.ports import Sink
from poller.sources.keyset.source import SqlSource
from poller.state.memory import MemoryStateStore
from poller.tick.lifecycle import TickResult, run_tick
from shared.config import AppConfig, Config, PollerConfig
from shared.models import HandlerContext, RowChange
from tests.fanout.transports import Transport
from tests.poller.tick_support import SourceTable, make_poller
from worker.idempotency import ProcessedEvents
from worker.runtime import Worker
from worker.split import Splitter


class Target:
    """The handler's destination: a table upserted with the processed-events helper."""

    def __init__(self, url: str, *, dedupe: bool = True) -> None:
        self.engine = sa.create_engine(url)
        with self.engine.begin() as conn:
            conn.execute(sa.text("CREATE TABLE target (id INTEGER PRIMARY KEY, version BIGINT, v VARCHAR(40))"))
            conn.execute(sa.text("CREATE TABLE handled (event_id VARCHAR(64), message_id VARCHAR(128))"))
        self.processed = ProcessedEvents(self.engine) if dedupe else None
        self.calls = 0

    def handle(self, events: list[RowChange], context: HandlerContext) -> None:
        self.calls += 1
        with self.engine.begin() as conn:  # all or nothing: a poison row rolls the whole message back
            fresh = self.processed.fresh(conn, events) if self.processed else events
            for e in fresh:
                assert e.after is not None
                if e.after["v"] == "poison":
                    raise ValueError(f"poison row {e.pk}")
                conn.execute(sa.text("INSERT INTO handled VALUES (:e, :m)"), {"e": e.event_id, "m": context.message_id})
                conn.execute(sa.text("DELETE FROM target WHERE id = :i"), {"i": e.pk["id"]})
                conn.execute(
                    sa.text("INSERT INTO target VALUES (:i, :ver, :v)"),
                    {"i": e.pk["id"], "ver": e.cursor, "v": e.after["v"]},
                )

    def rows(self) -> set[tuple[int, int]]:
        with self.engine.connect() as conn:
            return {(r[0], r[1]) for r in conn.execute(sa.text("SELECT id, version FROM target"))}

    def handled_event_ids(self) -> list[str]:
        with self.engine.connect() as conn:
            return [r[0] for r in conn.execute(sa.text("SELECT event_id FROM handled"))]


@dataclass
class Pipeline:
    transport: Transport
    source_table: SourceTable
    target: Target
    poller: PollerConfig
    store: MemoryStateStore = field(default_factory=lambda: MemoryStateStore("orders"))

    @classmethod
    def build(cls, transport: Transport, tmp_path: Path, *, dedupe: bool = True) -> Pipeline:
        table = SourceTable(f"sqlite:///{tmp_path / 'source.db'}")
        poller = replace(
            make_poller(str(table.engine.url)),
            queue=transport.queue,
            batch_size=100,
            transport="storage-queue" if transport.name == "storage-queue" else "servicebus",
        )
        return cls(transport, table, Target(f"sqlite:///{tmp_path / 'target.db'}", dedupe=dedupe), poller)

    @property
    def config(self) -> Config:
        return Config(app=AppConfig(name="test"), pollers={self.poller.name: self.poller})

    def sink(self, **kwargs: Any) -> Sink:
        return self.transport.sink(self.poller, **kwargs)

    def tick(self, sink: Sink | None = None) -> TickResult:
        return run_tick(self.poller, SqlSource(self.poller), self.store, sink or self.sink(), owner_id="poller")

    def worker(self, **kwargs: Any) -> Worker:
        splitter = Splitter(self.config, self.transport.send_all)
        return Worker(self.config, splitter=splitter, handlers={"orders": self.target.handle}, **kwargs)

    def consume_until(self, worker: Worker, done: Callable[[], bool], timeout: float = 60.0) -> None:
        self.transport.consume_until(worker, done, timeout)

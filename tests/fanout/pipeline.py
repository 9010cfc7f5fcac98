"""A real pipeline in one process: SQLite source → tick → emulator queue → worker → SQLite target."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from azure.servicebus import ServiceBusClient

from poller.sink_servicebus import ServiceBusSink
from poller.source import SqlSource
from poller.state_memory import MemoryStateStore
from poller.tick import TickResult, run_tick
from sbemulator import Emulator
from sbemulator.testing import unique_queue
from shared.config import AppConfig, Config, PollerConfig
from shared.messages import OutgoingMessage
from shared.models import HandlerContext, RowChange
from shared.servicebus import QueueSender
from tests.poller.tick_support import SourceTable, make_poller
from worker.consumer import settle_received
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
    emulator: Emulator
    client: ServiceBusClient
    source_table: SourceTable
    target: Target
    poller: PollerConfig
    store: MemoryStateStore = field(default_factory=lambda: MemoryStateStore("orders"))

    @classmethod
    def build(
        cls, emulator: Emulator, client: ServiceBusClient, tmp_path: Path, *, dedupe: bool = True, **queue_props: Any
    ) -> Pipeline:
        props = {"requires_duplicate_detection": True, "lock_duration": "PT5S", "max_delivery_count": 3, **queue_props}
        queue = unique_queue(emulator, "orders", **props)
        table = SourceTable(f"sqlite:///{tmp_path / 'source.db'}")
        poller = replace(make_poller(str(table.engine.url)), queue=queue, batch_size=100)
        return cls(emulator, client, table, Target(f"sqlite:///{tmp_path / 'target.db'}", dedupe=dedupe), poller)

    @property
    def config(self) -> Config:
        return Config(app=AppConfig(name="test"), pollers={self.poller.name: self.poller})

    def sink(self, **kwargs: Any) -> ServiceBusSink:
        return ServiceBusSink(self.poller, QueueSender(self.client, self.poller.queue), **kwargs)

    def tick(self, sink: ServiceBusSink | None = None) -> TickResult:
        return run_tick(self.poller, SqlSource(self.poller), self.store, sink or self.sink(), owner_id="poller")

    def worker(self, **kwargs: Any) -> Worker:
        senders: dict[str, QueueSender] = {}

        def send_all(queue: str, messages: list[OutgoingMessage]) -> None:
            senders.setdefault(queue, QueueSender(self.client, queue)).send_all(messages)

        return Worker(
            self.config, splitter=Splitter(self.config, send_all), handlers={"orders": self.target.handle}, **kwargs
        )

    def consume_until(self, worker: Worker, done: Callable[[], bool], timeout: float = 60.0) -> None:
        """Receive and settle (Functions semantics) until ``done()`` holds."""
        deadline = time.monotonic() + timeout
        with self.client.get_queue_receiver(self.poller.queue) as receiver:
            while not done():
                if time.monotonic() > deadline:
                    raise TimeoutError("the pipeline did not reach the expected state in time")
                for msg in receiver.receive_messages(max_message_count=20, max_wait_time=0.5):
                    settle_received(receiver, msg, worker.process)

    def stats(self) -> dict[str, int]:
        return self.emulator.queue_stats(self.poller.queue)

"""A page's delivery in flight while the tick reads and packs the next (poller/send_ahead.py).

With a sink that splits its send (``prepare`` then ``deliver``: the queue sinks) and a keyset
source, the tick delivers a page on a background thread while it packs the next one. The seed's
invariants hold as when it sends inline: no row lost, pages delivered in order and one at a time,
no checkpoint ahead of a page the sink accepted, and after a failed delivery the checkpoint lands
at the last accepted page and the page packed meanwhile is discarded, never sent.

Source: SQLite, 10 rows a page; state in memory. Deliveries are held on events where the order
between threads matters; every wait has a timeout.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from poller.source import SqlSource
from poller.state_memory import MemoryStateStore
from poller.tick import run_tick
from shared.config import PollerConfig
from shared.errors import EnqueueError
from shared.models import Batch
from tests.poller.conftest import FakeClock
from tests.poller.test_pipelined_commits import CommitSpy, committed, end_of_page
from tests.poller.tick_support import RecordingSink, SourceTable, drain, make_poller
from tests.support.ports import wait_until

TIMEOUT = 10.0
NOTHING_WITHIN = 0.2  # how long "the tick packs no further page" is watched


@dataclass
class Prepared:
    batch: Batch
    discarded: bool = False

    def discard(self) -> None:
        self.discarded = True


@dataclass
class SplitSink(RecordingSink):
    """A RecordingSink whose send is prepare + deliver; records where and how deliveries ran."""

    prepared: list[Prepared] = field(default_factory=list)
    threads: list[int] = field(default_factory=list)  # the thread of each delivery
    overlaps: int = 0  # deliveries that started while another one ran
    hold: threading.Event | None = None  # deliveries wait for it (set: they go on)
    _running: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def prepare(self, batch: Batch) -> Prepared:
        prepared = Prepared(batch)
        self.prepared.append(prepared)
        return prepared

    def deliver(self, prepared: Prepared) -> None:
        with self._lock:
            self.overlaps += self._running
            self._running += 1
            self.threads.append(threading.get_ident())
        try:
            if self.hold is not None:
                assert self.hold.wait(TIMEOUT), "a held delivery was never released"
            RecordingSink.send(self, prepared.batch)
        finally:
            with self._lock:
                self._running -= 1

    def send(self, batch: Batch) -> None:
        self.deliver(self.prepare(batch))


@pytest.fixture
def table(tmp_path: Path) -> SourceTable:
    return SourceTable(f"sqlite:///{tmp_path / 'src.db'}")


def _poller(table: SourceTable, depth: int = 4) -> PollerConfig:
    return make_poller(str(table.engine.url), max_uncommitted_batches=depth)


def test_pages_are_delivered_in_order_one_at_a_time_off_the_ticks_thread(table: SourceTable) -> None:
    poller = _poller(table)
    table.upsert(range(205))  # 20 full pages and a short one
    sink = SplitSink()
    store = MemoryStateStore(poller.name)
    drain(poller, SqlSource(poller), store, sink)
    assert set(sink.delivered()) == table.states()
    ids = [e.pk["id"] for b in sink.accepted for e in b.events]
    assert ids == sorted(ids) and len(ids) == 205  # in page order, once each
    assert sink.overlaps == 0
    tick_thread = threading.get_ident()
    assert sink.threads[:20].count(tick_thread) == 0  # full pages: delivered in the background
    assert sink.threads[20] == tick_thread  # the short last page: inline, nothing to pack meanwhile
    assert committed(store) == (204, 205)


def test_no_checkpoint_is_written_ahead_of_a_page_the_sink_accepted(table: SourceTable) -> None:
    poller = _poller(table)
    table.upsert(range(300))
    sink = SplitSink()
    store = MemoryStateStore(poller.name)
    spy = CommitSpy(store, sink)
    drain(poller, SqlSource(poller), store, sink)
    assert spy.ahead == []
    assert spy.landed and committed(store) == end_of_page(30)


def test_the_tick_packs_at_most_one_page_ahead_of_the_delivery_in_flight(table: SourceTable) -> None:
    poller = _poller(table, depth=16)
    table.upsert(range(100))
    hold = threading.Event()
    sink = SplitSink(hold=hold)
    store = MemoryStateStore(poller.name)
    outcome: list[object] = []
    tick = threading.Thread(target=lambda: outcome.append(run_tick(poller, SqlSource(poller), store, sink)))
    tick.start()
    try:
        # Given page 1's delivery is held: the tick packs page 2 and waits for it, nothing more
        wait_until(lambda: len(sink.prepared) >= 2, TIMEOUT, "page 2 packed while page 1 is in flight")
        with pytest.raises(TimeoutError):  # watched for NOTHING_WITHIN: can only pass wrongly, not fail wrongly
            wait_until(lambda: len(sink.prepared) > 2, NOTHING_WITHIN, "a third page packed")
        assert committed(store) is None  # page 1 not accepted: no checkpoint
    finally:
        hold.set()
        tick.join(TIMEOUT)
    assert not tick.is_alive() and outcome
    assert set(sink.delivered()) == table.states()
    assert committed(store) == end_of_page(10)


def test_a_failed_delivery_lands_the_pages_before_it_and_drops_the_one_packed_meanwhile(table: SourceTable) -> None:
    clock = FakeClock()
    poller = _poller(table)
    source = SqlSource(poller)
    table.upsert(range(100))
    store = MemoryStateStore(poller.name)
    sink = SplitSink()

    def refuse_page_6(batch: Batch) -> None:
        if len(sink.accepted) == 5 and not refused:
            refused.append(batch)
            raise EnqueueError("broker refused page 6 (injected)")

    refused: list[Batch] = []
    sink.before_accept = refuse_page_6
    # When page 6's delivery fails; Then the tick raises it
    with pytest.raises(EnqueueError, match="page 6"):
        run_tick(poller, source, store, sink, owner_id="a", clock=clock)
    # And the checkpoint is at the end of page 5 (every accepted page landed), nothing past it sent
    assert committed(store) == end_of_page(5)
    assert len(sink.accepted) == 5
    # And page 7, packed while page 6 was in flight, was discarded, never delivered
    assert [p.batch.batch_id for p in sink.prepared if p.discarded] == [sink.prepared[6].batch.batch_id]
    # When the next tick drains; Then it starts at page 6 and nothing is lost
    drain(poller, source, store, sink, clock=clock)
    assert set(sink.delivered()) == table.states()
    assert committed(store) == end_of_page(10)


def test_the_strict_order_delivers_every_page_on_the_ticks_thread(table: SourceTable) -> None:
    poller = _poller(table, depth=1)
    table.upsert(range(50))
    sink = SplitSink()
    drain(poller, SqlSource(poller), MemoryStateStore(poller.name), sink)
    assert set(sink.delivered()) == table.states()
    assert set(sink.threads) == {threading.get_ident()}

"""kind = "pg_logical": a peek whose cap falls inside an ordinary transaction does not end the tick.

A peek decodes ``PgLogicalSource.MAX_DECODED`` changes at most. On main, a peek that reached its
cap in the middle of a 100-change transaction spooled that transaction, the page ended short at
the spool's end, and the tick read that short page as "caught up": a 200k-change backlog stopped
after 62,000 rows, though the slot held more (the next tick a whole timer period later). The cap
is lowered here so that a few thousand changes cross it several times.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from poller.sources.pg_logical.peek import Buffer, SlotReader
from poller.sources.pg_logical.source import PgLogicalSource
from poller.state.memory import MemoryStateStore
from poller.tick.lifecycle import run_tick
from tests.poller.pg_logical_support import LogicalTable, events_of, logical_table, poller_config
from tests.poller.tick_support import RecordingSink, drain

pytestmark = pytest.mark.integration

TXNS, SIZE, CAP = 30, 100, 250  # the cap falls inside every third transaction or so


@pytest.fixture
def logical(pg_logical_url: str) -> Iterator[LogicalTable]:
    with logical_table(pg_logical_url) as table:
        yield table


@pytest.mark.parametrize("uncommitted", [1, 4], ids=["sequential", "read-ahead"])
def test_one_tick_with_budget_enough_delivers_a_backlog_whose_peeks_stop_mid_transaction(
    logical: LogicalTable, uncommitted: int
) -> None:
    # Given 30 transactions of 100 changes, and a peek cap of 250 (never a transaction boundary)
    for t in range(TXNS):
        logical.insert(range(t * SIZE + 1, (t + 1) * SIZE + 1))
    config = poller_config(
        logical.url, logical.name, batch_size=60, max_batches_per_tick=200, max_uncommitted_batches=uncommitted,
        tick_budget_seconds=120,
    )  # fmt: skip
    store, sink = MemoryStateStore("p"), RecordingSink()
    source = PgLogicalSource(config)
    source.MAX_DECODED = CAP
    try:
        # When one tick runs, with budget enough for the whole backlog
        result = run_tick(config, source, store, sink, owner_id="a")
    finally:
        source.close()
    # Then it delivers all of it, in commit order (main: "caught_up" at the first spool's end)
    assert [e.pk["id"] for e in events_of(sink.accepted)] == list(range(1, TXNS * SIZE + 1))
    assert result.rows == TXNS * SIZE and result.stop_reason == "caught_up"


def test_a_tick_goes_on_past_a_spooled_transaction_once_its_checkpoint_landed(logical: LogicalTable) -> None:
    # Given a transaction far larger than the cap (it is spooled), then small ones, and each
    # page's checkpoint landed before the next fetch (max_uncommitted_batches = 1)
    logical.sql("INSERT INTO {t} (id, v, n) SELECT g, 'big', 0 FROM generate_series(1, 2000) g")
    for i in range(2001, 2011):
        logical.insert([i])
    config = poller_config(
        logical.url, logical.name, batch_size=300, max_batches_per_tick=100, max_uncommitted_batches=1,
        tick_budget_seconds=120,
    )  # fmt: skip
    store, sink = MemoryStateStore("p"), RecordingSink()
    source = PgLogicalSource(config)
    source.MAX_DECODED = CAP
    try:
        # When one tick runs
        result = run_tick(config, source, store, sink, owner_id="a")
        spool_after = source.spool_bytes
    finally:
        source.close()
    # Then it goes on past the spool's end (the slot moved past it mid-tick): everything, in order
    assert [e.pk["id"] for e in events_of(sink.accepted)] == list(range(1, 2011))
    assert result.rows == 2010 and result.stop_reason == "caught_up"
    assert spool_after == 0


def test_a_peek_holds_a_quarter_of_its_cap_more_at_most_and_spools_a_larger_transaction(
    logical: LogicalTable, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given small transactions, then one of 2,000 changes (8x the cap), then a small one
    for t in range(3):
        logical.insert(range(t * SIZE + 1, (t + 1) * SIZE + 1))
    logical.sql("INSERT INTO {t} (id, v, n) SELECT g, 'big', 0 FROM generate_series(1001, 3000) g")
    logical.insert([3001])
    kept: list[int] = []
    spooled: list[bool] = []
    peek = SlotReader._peek

    def recorded(self: SlotReader, *args: Any) -> Buffer:
        buffer = peek(self, *args)
        kept.append(len(buffer.changes))
        spooled.append(self.spool is not None)
        return buffer

    monkeypatch.setattr(SlotReader, "_peek", recorded)
    config = poller_config(logical.url, logical.name, batch_size=60, max_batches_per_tick=200)
    store, sink = MemoryStateStore("p"), RecordingSink()
    source = PgLogicalSource(config)
    source.MAX_DECODED = CAP
    try:
        # When the poller drains (with read-ahead a tick still ends at a spool's end whose checkpoint had not landed)
        for _ in range(20):
            drain(config, source, store, sink, max_ticks=20)
            if len(events_of(sink.accepted)) >= 2301:
                break
    finally:
        source.close()
    # Then everything arrives in order, no peek kept more than 1.25x its cap, and the big one was spooled
    assert [e.pk["id"] for e in events_of(sink.accepted)] == [*range(1, 301), *range(1001, 3002)]
    assert kept and max(kept) <= CAP + CAP // 4
    assert any(spooled)

"""kind = "pg_logical" and one huge transaction (a backfill, a migration): delivered whole, by a
fresh source too, with the server decoding it once (issue 33).

A transaction larger than a peek's cap (``PgLogicalSource.MAX_DECODED``) is what these tests are
about; the cap is lowered here so that a few thousand rows are "huge" and the tests stay fast.
The case that stalled a fresh process for good on main is reproduced at its real size (wide rows,
the default cap): a cancelled peek aborted the transaction the next statement ran in.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from poller.pg_logical import PgLogicalSource
from poller.state_memory import MemoryStateStore
from tests.poller.pg_logical_support import LogicalTable, events_of, logical_table, poller_config
from tests.poller.tick_support import RecordingSink, drain

pytestmark = pytest.mark.integration

#: 40,000 rows of 500 bytes: a peek stopped at the default cap leaves ~10 MB unsent, so its
#: cancel reaches the server while the statement still runs (60,000 narrow rows raced on main).
WIDE_ROWS, WIDTH = 40_000, 500


@pytest.fixture
def logical(pg_logical_url: str) -> Iterator[LogicalTable]:
    with logical_table(pg_logical_url) as table:
        yield table


def _one_transaction(table: LogicalTable, rows: int, width: int = 1) -> None:
    table.sql(f"INSERT INTO {{t}} (id, v, n) SELECT g, repeat('x', {width}), 0 FROM generate_series(1, {rows}) g")


def test_a_fresh_source_whose_first_change_is_a_huge_transaction_delivers_it(logical: LogicalTable) -> None:
    # Given a process that has read nothing yet (no primary key looked up) and a huge first change
    _one_transaction(logical, WIDE_ROWS, WIDTH)
    config = poller_config(logical.url, logical.name, batch_size=1000, max_batches_per_tick=20)
    store, sink = MemoryStateStore("p"), RecordingSink()
    source = PgLogicalSource(config)
    try:
        # When it drains (on main: "current transaction is aborted" on every tick, nothing sent)
        drain(config, source, store, sink, max_ticks=20)
    finally:
        source.close()
    # Then every row arrives, once each by event id
    events = events_of(sink.accepted)
    assert sorted(e.pk["id"] for e in events) == list(range(1, WIDE_ROWS + 1))

"""kind = "pg_logical" and one huge transaction (a backfill, a migration): delivered whole, by a
fresh source too, with the server decoding it once (issue 33).

A transaction larger than a peek's cap (``PgLogicalSource.MAX_DECODED``) is what these tests are
about; the cap is lowered here so that a few thousand rows are "huge" and the tests stay fast.
The case that stalled a fresh process for good on main is reproduced at its real size (wide rows,
the default cap): a cancelled peek aborted the transaction the next statement ran in.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from poller.sources.pg_logical.source import PgLogicalSource
from poller.state.blob import open_state_store
from poller.state.memory import MemoryStateStore
from poller.tick.lifecycle import run_tick
from shared.codec import decode_batch
from shared.config import PollerConfig
from shared.settings import StorageConnection
from tests.conftest import FULL
from tests.poller.pg_logical_support import LogicalTable, events_of, logical_table, poller_config, summary
from tests.poller.tick_support import RecordingSink, drain
from tests.support.azurite import Azurite
from tests.support.databases import unique_name

pytestmark = pytest.mark.integration

#: The killed backfill: rows of its transaction, the peek's cap, batch_size, the page killed after.
KILLED = (200_000, PgLogicalSource.MAX_DECODED, 1000, 60) if FULL else (4000, 500, 200, 8)

ROOT = Path(__file__).resolve().parents[4]

#: 40,000 rows of 500 bytes: a peek stopped at the default cap leaves ~10 MB unsent, so its
#: cancel reaches the server while the statement still runs (60,000 narrow rows raced on main).
WIDE_ROWS, WIDTH = 40_000, 500


@pytest.fixture
def logical(pg_logical_url: str) -> Iterator[LogicalTable]:
    with logical_table(pg_logical_url) as table:
        yield table


@pytest.fixture
def own_database(pg_logical_url: str) -> Iterator[LogicalTable]:
    """A table in a database of its own: a slot decodes only its database's transactions, so the
    server's decoding statistics count this test's alone (the server is shared)."""
    name = unique_name("bf")
    admin = sa.create_engine(pg_logical_url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(sa.text(f"CREATE DATABASE {name}"))
        url = sa.make_url(pg_logical_url).set(database=name).render_as_string(hide_password=False)
        try:
            with logical_table(url) as table:
                yield table
        finally:
            with admin.connect() as conn:
                conn.execute(sa.text(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
    finally:
        admin.dispose()


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


def _decoded(table: LogicalTable) -> tuple[int, int]:
    """Transactions the server decoded for the slot so far, and their bytes (pg_stat_replication_slots)."""
    with table.engine.connect() as conn:
        row = conn.execute(
            sa.text("SELECT total_txns, total_bytes FROM pg_stat_replication_slots WHERE slot_name = :s"),
            {"s": table.config.slot},
        ).first()
    return (int(row[0]), int(row[1])) if row is not None else (0, 0)


def _drain_all(config: PollerConfig, source: PgLogicalSource, store: MemoryStateStore, sink: RecordingSink,
               rows: int) -> None:  # fmt: skip
    """Ticks until ``rows`` events arrived (a tick ends where a spooled transaction does)."""
    for _ in range(50):
        drain(config, source, store, sink, max_ticks=50)
        if len(events_of(sink.accepted)) >= rows:
            return
    raise AssertionError(f"{len(events_of(sink.accepted))} of {rows} events arrived")


def test_huge_transactions_between_small_ones_are_decoded_once_each_and_arrive_in_order(
    own_database: LogicalTable,
) -> None:
    logical = own_database
    # Given small transactions around two transactions far larger than a peek's cap
    for i in (1, 2, 3):
        logical.insert([i], "small")
    logical.sql("INSERT INTO {t} (id, v, n) SELECT g, 'big', 0 FROM generate_series(100, 5099) g")
    logical.insert([4], "small")
    logical.sql("UPDATE {t} SET v = 'bigger' WHERE id >= 100")
    logical.insert([5], "small")
    expected = [("insert", i, "small") for i in (1, 2, 3)] + [("insert", i, "big") for i in range(100, 5100)]
    expected += [("insert", 4, "small")] + [("update", i, "bigger") for i in range(100, 5100)]
    expected += [("insert", 5, "small")]
    config = poller_config(logical.url, logical.name, batch_size=300, max_batches_per_tick=5)
    store, sink = MemoryStateStore("p"), RecordingSink()
    source = PgLogicalSource(config)
    source.MAX_DECODED = 1000  # a peek decodes 1000 changes at most: each big one is 5x that
    decoded_before = _decoded(logical)[0]
    try:
        # When the poller drains, page by page over several ticks
        _drain_all(config, source, store, sink, len(expected))
    finally:
        source.close()
    # Then every change arrives once, in commit order
    assert summary(events_of(sink.accepted)) == expected
    # and the server decoded each of the seven transactions once (main: the big ones 5+ times each)
    assert _decoded(logical)[0] - decoded_before == 7


def test_a_backfill_killed_mid_transaction_resumes_from_its_checkpoint_without_loss(
    logical: LogicalTable, azurite: Azurite, tmp_path: Path
) -> None:
    # Given a transaction of BIG rows between small ones, larger than the cap (it is spooled),
    # and each page's commit landed before the next send
    big, cap, batch, kill = KILLED
    logical.insert([1, 2], "small")
    logical.sql(f"INSERT INTO {{t}} (id, v, n) SELECT g, 'big', 0 FROM generate_series(100, {99 + big}) g")
    logical.insert([3], "small")
    expected = [("insert", i, "small") for i in (1, 2)] + [("insert", i, "big") for i in range(100, 100 + big)]
    expected += [("insert", 3, "small")]
    logical.config = dataclasses.replace(
        logical.config, batch_size=batch, max_batches_per_tick=1000, max_uncommitted_batches=1, lease_ttl_seconds=120
    )
    container, out = f"t-{uuid.uuid4().hex[:20]}", tmp_path / "queue.jsonl"
    # When a tick process is SIGKILLed right after a page was accepted (the ones before landed: mid-transaction)
    args = [json.dumps(dataclasses.asdict(logical.config)), azurite.connection_string, container, str(out)]
    proc = subprocess.run(
        [sys.executable, "-m", "tests.poller.pg_logical_killed_tick", *args, f"send:{kill}", str(cap)],
        cwd=ROOT, capture_output=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    killed = [decode_batch(line) for line in out.read_bytes().splitlines() if line]
    later = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=logical.config.lease_ttl_seconds * 3)
    store = open_state_store(
        StorageConnection(connection_string=azurite.connection_string), container, "t", logical.config.name,
        clock=lambda: later,
    )  # fmt: skip
    snap = store.load()
    assert snap is not None and snap.doc.checkpoint.position is not None
    landed = snap.doc.checkpoint.position
    assert 0 < int(landed.pk["seq"]) < big - 1  # the checkpoint is inside the big transaction
    # and a fresh process drains on from that checkpoint (its own spool, read from the slot)
    sink = RecordingSink()
    source = PgLogicalSource(logical.config)
    source.MAX_DECODED = cap
    try:
        for _ in range(20):
            drain(logical.config, source, store, sink, owner_id="next", clock=lambda: later)
            if len(events_of([*killed, *sink.accepted])) >= len(expected):
                break
    finally:
        source.close()
    # Then every change arrived, in commit order, once after de-duplication, and nothing at or
    # before the landed checkpoint was sent again
    assert summary(events_of([*killed, *sink.accepted])) == expected
    assert sink.accepted[0].events[0].pk == {"id": 100 + int(landed.pk["seq"]) + 1}


def test_a_huge_transaction_whose_tail_is_not_the_pollers_is_passed(logical: LogicalTable) -> None:
    # Given one transaction: 3,000 rows of the poller's table, then 2,000 changes it does not
    # deliver (another poller's signal row, in the same publication), then a small transaction
    signal = logical.config.signal_table
    logical.sql(
        "INSERT INTO {t} (id, v, n) SELECT g, 'big', 0 FROM generate_series(1, 3000) g",
        f"INSERT INTO {signal} (poller, kind, id) VALUES ('another', 'watermark', '0')",
        f"DO $$ BEGIN FOR i IN 1..2000 LOOP UPDATE {signal} SET id = i::text WHERE poller = 'another';"
        " END LOOP; END $$",
    )
    logical.insert([5000], "after")
    config = poller_config(logical.url, logical.name, batch_size=300, max_batches_per_tick=5)
    store, sink = MemoryStateStore("p"), RecordingSink()
    source = PgLogicalSource(config)
    source.MAX_DECODED = 1000
    try:
        # When the poller drains
        _drain_all(config, source, store, sink, 3001)
    finally:
        source.close()
    # Then its rows arrive, and the change after the transaction too (the tail did not stall it)
    expected = [("insert", i, "big") for i in range(1, 3001)] + [("insert", 5000, "after")]
    assert summary(events_of(sink.accepted)) == expected


def test_a_spool_is_dropped_when_the_lease_goes_elsewhere_and_the_new_owner_delivers_the_rest(
    logical: LogicalTable,
) -> None:
    # Given process A read a huge transaction into its spool and delivered part of it
    logical.sql("INSERT INTO {t} (id, v, n) SELECT g, 'big', 0 FROM generate_series(1, 3000) g")
    config = poller_config(logical.url, logical.name, batch_size=300, max_batches_per_tick=2)
    store, sink = MemoryStateStore("p"), RecordingSink()
    a, b = PgLogicalSource(config), PgLogicalSource(config)
    a.MAX_DECODED = b.MAX_DECODED = 1000
    try:
        assert run_tick(config, a, store, sink, owner_id="a").rows == 600
        assert a.spool_bytes > 0
        # When process B holds the lease at A's next tick
        held = store.try_acquire("b", dt.timedelta(seconds=30), a.fingerprint)
        assert held is not None
        result = run_tick(config, a, store, sink, owner_id="a")
        # Then A drops its spool (B delivers meanwhile; a later fetch of A's reads the slot again)
        assert result.stop_reason == "lease_held" and a.spool_bytes == 0
        # and B, whose lease it is, delivers the rest from the checkpoint
        store.release(held)
        _drain_all(config, b, store, sink, 3000)
    finally:
        a.close()
        b.close()
    assert summary(events_of(sink.accepted)) == [("insert", i, "big") for i in range(1, 3001)]

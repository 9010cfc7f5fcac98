"""Each change-log source gives its events their commit time (issue 24): pg_logical the
transaction's commit timestamp, the outbox its row's created_at. It travels in the envelope
(``committed_at``) so the worker can measure commit -> handler latency per event."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from poller.sources.outbox import OutboxSource
from poller.sources.pg_logical.source import PgLogicalSource
from poller.state.memory import MemoryStateStore
from poller.tick.events import page_batch
from shared.codec import decode_batch, encode_batch
from shared.config import PollerConfig
from shared.outbox import outbox_ddl, write_change
from shared.telemetry import metrics
from tests.poller.pg_logical_support import LogicalTable, events_of, logical_table
from tests.poller.tick_support import RecordingSink, drain

pytestmark = pytest.mark.integration


@pytest.fixture
def logical(pg_logical_url: str) -> Iterator[LogicalTable]:
    with logical_table(pg_logical_url) as table:
        yield table


def test_pg_logical_events_carry_their_transactions_commit_time(logical: LogicalTable) -> None:
    # Given two transactions committed a moment apart
    before = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=5)  # the server's clock may differ a little
    logical.insert([1, 2], "a")
    logical.insert([3], "b")
    after = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=5)
    # When the poller reads them
    sink = RecordingSink()
    drain(logical.config, PgLogicalSource(logical.config), MemoryStateStore("p"), sink)
    events = events_of(sink.accepted)
    # Then each event has its transaction's commit time (the first two the same), through the codec too
    times = [e.committed_at for e in events]
    assert len(times) == 3 and all(t is not None and before <= t <= after for t in times)
    assert times[0] == times[1] and times[1] is not None and times[2] is not None and times[1] <= times[2]
    (decoded,) = [decode_batch(encode_batch(b)) for b in sink.accepted[:1]]
    assert [e.committed_at for e in decoded.events] == times[: len(decoded.events)]
    # And the acknowledged slot reported the WAL it retains and its backlog (the gauges operators alert on)
    attrs = {"poller": logical.config.name, "slot": PgLogicalSource(logical.config).slot}
    retained, backlog = metrics.retained_wal_bytes.get(attrs), metrics.lag_wal_bytes.get(attrs)
    assert retained is not None and retained >= 0 and backlog is not None and backlog >= 0


def test_outbox_events_carry_their_rows_created_at(tmp_path: Path) -> None:
    # Given an outbox row written now (SQLite stores created_at as UTC text)
    url = f"sqlite:///{tmp_path / 'o.db'}"
    engine = sa.create_engine(url)
    table, index = outbox_ddl("sqlite", "dbfanout_outbox")
    before = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=1)
    with engine.begin() as conn:
        conn.exec_driver_sql(table)
        conn.exec_driver_sql(index)
        write_change(conn, aggregate="42", type="created", payload={"id": 42})
    after = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=1)
    cfg = PollerConfig(
        name="o",
        source_url=url,
        table="dbfanout_outbox",
        queue="q",
        kind="outbox",
        settle_seconds=0,
        cursor="id",
        pk=("aggregate",),
    )
    source = OutboxSource(cfg)
    # When the poller reads it; Then its event has the row's creation time, through the codec too
    (event,) = page_batch(cfg, source.fingerprint, source.fetch(None, 10)).events
    assert event.committed_at is not None and before <= event.committed_at <= after
    (decoded,) = decode_batch(encode_batch(page_batch(cfg, source.fingerprint, source.fetch(None, 10)))).events
    assert decoded.committed_at == event.committed_at
    engine.dispose()

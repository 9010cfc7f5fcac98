"""Late commits on PostgreSQL (DESIGN §3.5): the hazard, and the two defences.

Two connections drive the interleaving deterministically: transaction A takes its cursor
(``now()``, its start time) first but commits last; B starts later, commits first. A poll between
the two commits moves the checkpoint past A's cursor.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

import pytest
import sqlalchemy as sa

from poller.ports import SourceRow
from poller.sources.keyset.source import SqlSource
from shared.models import Position
from tests.poller.source_fixtures import poller_config
from tests.support.databases import unique_name

pytestmark = pytest.mark.integration


class Table:
    def __init__(self, engine: sa.Engine, name: str) -> None:
        self.engine, self.name = engine, name

    def begin(self) -> sa.Connection:
        conn = self.engine.connect()
        conn.begin()
        return conn

    def insert(self, conn: sa.Connection, label: str) -> None:
        conn.execute(sa.text(f"INSERT INTO {self.name} (label) VALUES (:label)"), {"label": label})


@pytest.fixture
def table(pg_url: str) -> Iterator[Table]:
    engine = sa.create_engine(pg_url)
    name = unique_name("late")
    with engine.begin() as conn:
        conn.exec_driver_sql(
            f"CREATE TABLE {name} (id bigserial PRIMARY KEY, label text NOT NULL, "
            "c timestamptz NOT NULL DEFAULT now(), txid xid8 NOT NULL DEFAULT pg_current_xact_id())"
        )
        conn.exec_driver_sql(f"CREATE INDEX ix_{name} ON {name} (c, id)")
    yield Table(engine, name)
    with engine.begin() as conn:
        conn.exec_driver_sql(f"DROP TABLE {name}")
    engine.dispose()


def _poll(source: SqlSource, after: Position | None) -> tuple[list[SourceRow], Position | None]:
    page = source.fetch(after, 100)
    return list(page.rows), page.last or after


def _poll_until(source: SqlSource, after: Position | None, want: int, deadline_s: float) -> list[SourceRow]:
    """Poll (as the timer would) until ``want`` rows arrived or the deadline passed."""
    rows: list[SourceRow] = []
    deadline = time.monotonic() + deadline_s
    while len(rows) < want and time.monotonic() < deadline:
        page, after = _poll(source, after)
        rows += page
        if len(rows) < want:
            time.sleep(0.1)
    return rows


def _labels(rows: Sequence[SourceRow]) -> list[str]:
    return [r.values["label"] for r in rows]


def _early_commits_last(t: Table, source: SqlSource) -> tuple[list[SourceRow], Position | None]:
    """A inserts 'early', B inserts and commits 'late', we poll, then A commits."""
    a = t.begin()
    t.insert(a, "early")  # c = A's now(), taken first
    b = t.begin()
    t.insert(b, "late")  # c = B's now(), later
    b.commit()
    b.close()
    between, checkpoint = _poll(source, None)
    a.commit()
    a.close()
    return between, checkpoint


def test_without_a_settle_window_a_late_commit_behind_the_checkpoint_is_lost(table: Table) -> None:
    source = SqlSource(poller_config(str(table.engine.url), table=table.name, settle_seconds=0), table.engine)
    # When a poll runs between B's commit and A's commit
    between, checkpoint = _early_commits_last(table, source)
    after, _ = _poll(source, checkpoint)
    # Then 'late' is delivered, the checkpoint passes A's cursor, and 'early' is never read: the hazard
    assert _labels(between) == ["late"]
    assert after == []
    assert _labels(source.fetch(None, 100).rows) == ["early", "late"]  # it is there, behind the checkpoint


def test_a_settle_window_longer_than_the_transaction_loses_nothing(table: Table) -> None:
    source = SqlSource(poller_config(str(table.engine.url), table=table.name, settle_seconds=1), table.engine)
    between, checkpoint = _early_commits_last(table, source)
    # Then the poll in between saw nothing (both cursors are younger than the window) ...
    assert between == []
    # ... and once the window passed on the database clock, both arrive in cursor order
    assert _labels(_poll_until(source, checkpoint, want=2, deadline_s=10)) == ["early", "late"]


def test_the_xid_horizon_holds_back_rows_until_older_transactions_finish(table: Table) -> None:
    cfg = poller_config(str(table.engine.url), table=table.name, settle_seconds=0, xid_column="txid")
    source = SqlSource(cfg, table.engine)
    between, checkpoint = _early_commits_last(table, source)
    # Then 'late' was held back while A (an older transaction) was running; no waiting needed after
    assert between == []
    assert _labels(_poll_until(source, checkpoint, want=2, deadline_s=10)) == ["early", "late"]


def _late_first_write(t: Table, source: SqlSource) -> tuple[list[SourceRow], Position | None]:
    """A starts first (its now() is earliest) but writes only after B committed: A's xid is newer."""
    a = t.begin()
    a.execute(sa.text("SELECT now()"))  # A's transaction (and its now()) starts here, no xid yet
    b = t.begin()
    t.insert(b, "late")
    b.commit()
    b.close()
    t.insert(a, "early")  # c = A's start time (earliest), xid newer than B's
    between, checkpoint = _poll(source, None)
    a.commit()
    a.close()
    return between, checkpoint


def test_the_xid_horizon_with_a_now_cursor_misses_a_transaction_that_wrote_late(table: Table) -> None:
    # The documented gap: xid order is first-write order, not now() order (keep a settle window too)
    cfg = poller_config(str(table.engine.url), table=table.name, settle_seconds=0, xid_column="txid")
    source = SqlSource(cfg, table.engine)
    between, checkpoint = _late_first_write(table, source)
    assert _labels(between) == ["late"]
    assert _poll(source, checkpoint)[0] == []


def test_the_xid_column_as_cursor_with_its_horizon_is_exact(table: Table) -> None:
    cfg = poller_config(str(table.engine.url), table=table.name, cursor="txid", settle_seconds=0, xid_column="txid")
    source = SqlSource(cfg, table.engine)
    between, checkpoint = _late_first_write(table, source)
    assert _labels(between) == ["late"]
    assert _labels(_poll_until(source, checkpoint, want=1, deadline_s=10)) == ["early"]

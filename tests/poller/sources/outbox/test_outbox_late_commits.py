"""Late commits through the outbox: a transaction that commits after a later one is not skipped.

Two connections drive the interleaving deterministically. On PostgreSQL the transaction-id
horizon holds the read back (no clock involved); on MariaDB the settled prefix does, within the
settle window. SQLite cannot interleave two writers (one write transaction at a time), so ids are
handed out in commit order there. Each defence is shown against its control: the same
interleaving read without it loses the early transaction's change.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import pytest
import sqlalchemy as sa

from poller.ports import Page
from poller.sources.factory import open_source
from poller.sources.keyset.source import SqlSource
from shared.models import Position
from shared.outbox import write_change
from tests.poller.outbox_support import Outbox, outbox_poller, read_until
from tests.poller.source_fixtures import poller_config
from tests.support.ports import wait_until

pytestmark = pytest.mark.integration


@pytest.fixture
def pg_box(pg_url: str) -> Iterator[Outbox]:
    box = Outbox(pg_url)
    yield box
    box.drop()


@pytest.fixture
def maria_box(mysql_url: str) -> Iterator[Outbox]:
    box = Outbox(mysql_url)
    yield box
    box.drop()


def _types(page: Page) -> list[str | None]:
    return [row.event.change for row in page.rows if row.event is not None]


def _early_still_open_late_committed(box: Outbox) -> sa.Connection:
    """A writes 'early' (the lower id and xid) and stays open; B writes 'late' and commits. Returns A."""
    a = box.begin()
    write_change(a, box.name, aggregate="1", type="early")
    b = box.begin()
    write_change(b, box.name, aggregate="2", type="late")
    b.commit()
    return a


def _xid_first_outbox_id_last(box: Outbox) -> sa.Connection:
    """B takes its transaction id first, A writes the outbox first; B commits; A (returned) is open."""
    b = box.begin()
    b.exec_driver_sql("SELECT pg_current_xact_id()")  # B's xid: lower than A's
    a = box.begin()
    write_change(a, box.name, aggregate="1", type="early")  # A: the lower outbox id
    write_change(b, box.name, aggregate="2", type="late")
    b.commit()
    return a


def test_pg_the_xid_horizon_holds_back_what_a_running_transaction_could_precede(pg_box: Outbox) -> None:
    source = open_source(outbox_poller(str(pg_box.engine.url), pg_box.name))
    a = _early_still_open_late_committed(pg_box)
    # While A runs, B's change (a later transaction id) is not read
    page = source.fetch(None, 10)
    assert _types(page) == []
    a.commit()
    # Then both arrive, A first (as soon as no older transaction in the cluster holds the horizon)
    assert _types(Page(read_until(source, page.last, 2))) == ["early", "late"]


def test_pg_an_outbox_id_taken_before_a_commit_that_lands_later_is_not_skipped(pg_box: Outbox) -> None:
    url = str(pg_box.engine.url)
    source = open_source(outbox_poller(url, pg_box.name))
    by_id = SqlSource(poller_config(url, table=pg_box.name, cursor="id", pk=("id",)))  # the control
    a = _xid_first_outbox_id_last(pg_box)
    # B (the older transaction) is read; A's row, with the LOWER outbox id, is still invisible
    page, control = Page(read_until(source, None, 1)), by_id.fetch(None, 10)
    assert _types(page) == ["late"]
    a.commit()
    # Then A's change still arrives: the checkpoint is (txid, id), and A's txid is above it
    assert _types(Page(read_until(source, page.last, 1))) == ["early"]
    # The control, ordered by id alone, has moved past A's id: A is lost to it
    assert [r.values["type"] for r in by_id.fetch(control.last, 10).rows] == []


def test_mariadb_the_settled_prefix_holds_back_rows_behind_an_open_transaction(maria_box: Outbox) -> None:
    url = str(maria_box.engine.url)
    # A generous window: the read right after B's commit must happen inside it even on a loaded machine
    poller = outbox_poller(url, maria_box.name, settle_seconds=60)
    source = open_source(poller)
    a = _early_still_open_late_committed(maria_box)
    assert _types(source.fetch(None, 10)) == []  # B's row is inside the window: nothing past it is read
    a.commit()
    # Then, once settled (a short window here: the fingerprint ignores settle_seconds), both in order
    settled = open_source(replace(poller, settle_seconds=0.2))
    assert settled.fingerprint == source.fingerprint
    got: list[str | None] = []
    after: list[Position | None] = [None]

    def read() -> bool:
        page = settled.fetch(after[0], 10)
        got.extend(_types(page))
        after[0] = page.last or after[0]
        return len(got) >= 2

    wait_until(read, 30, "both outbox rows to settle")
    assert got == ["early", "late"]


def test_mariadb_without_a_settle_window_the_open_transaction_is_skipped(maria_box: Outbox) -> None:
    """The control: settle_seconds = 0 is safe with a single writer only."""
    source = open_source(outbox_poller(str(maria_box.engine.url), maria_box.name, settle_seconds=0))
    a = _early_still_open_late_committed(maria_box)
    page = source.fetch(None, 10)
    assert _types(page) == ["late"]
    a.commit()
    assert _types(source.fetch(page.last, 10)) == []


def test_mariadb_a_writer_in_another_time_zone_still_waits_out_the_window(maria_box: Outbox) -> None:
    # Given an application session five hours behind UTC (created_at must still be UTC)
    source = open_source(outbox_poller(str(maria_box.engine.url), maria_box.name, settle_seconds=60))
    with maria_box.engine.begin() as conn:
        conn.exec_driver_sql("SET time_zone = '-05:00'")
        write_change(conn, maria_box.name, aggregate="1", type="insert")
    # Then the fresh row is inside the 60 s window, not five hours old
    assert _types(source.fetch(None, 10)) == []

"""The order epoch (poller/tick/epochs.py, issue 39): cursors that go backwards start a new epoch,
the same one on every read of the page, and a page spanning two epochs goes as two batches.

The regression is real: a private MariaDB (binlog on) writes a poller's first changes in GTID
domain 9, then the next ones in domain 0, as a failover to a server whose GTIDs sort lower does.
Their cursors ``(domain, seq no, seq)`` go from ``(9, ...)`` back to ``(0, ...)``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from poller.sources.mysql_binlog.source import MysqlBinlogSource
from poller.state.memory import MemoryStateStore
from poller.tick.epochs import ORDER, Order, epoch_starts
from shared.codec import decode_batch
from shared.errors import CommitError
from shared.messages import pack_batch
from shared.models import Batch
from tests.poller.mysql_binlog_support import BinlogTables, binlog_tables
from tests.poller.tick_support import RecordingSink, drain


@pytest.fixture
def tables(mysql_binlog_url: str) -> Iterator[BinlogTables]:
    with binlog_tables(mysql_binlog_url) as made:
        yield made


def _in_domain(tables: BinlogTables, domain: int, *statements: str) -> None:
    """Each statement its own transaction, its GTID in ``domain`` (this session only)."""
    with tables.engine.connect() as conn:
        conn.execute(sa.text(f"SET SESSION gtid_domain_id = {domain}"))
        for statement in statements:
            conn.execute(sa.text(statement.format(t=tables.name)))
            conn.commit()


def _sent(batches: list[Batch]) -> list[tuple[str, int, list[Any]]]:
    """Each batch as its handler gets it (packed as the sinks pack it, decoded as the worker does)."""
    got = [decode_batch(m.body) for b in batches for m in pack_batch(b, 256 * 1024)]
    return [(b.batch_id, b.epoch, [(e.event_id, e.epoch, e.cursor[0]) for e in b.events]) for b in got]  # type: ignore[index]


@pytest.mark.integration
def test_cursors_that_go_backwards_start_a_new_epoch_the_same_on_a_resend__issue_39(tables: BinlogTables) -> None:
    store, sink = MemoryStateStore("p"), RecordingSink()
    source = MysqlBinlogSource(tables.config)
    drain(tables.config, source, store, sink)  # the starting point
    # Given changes in domain 9, then later ones in domain 0 (lower cursors), all in one page
    _in_domain(
        tables, 9, "INSERT INTO {t} (id, v, n) VALUES (1, 'a', 0)", "INSERT INTO {t} (id, v, n) VALUES (2, 'a', 0)"
    )
    _in_domain(tables, 0, "UPDATE {t} SET n = 1 WHERE id = 1", "INSERT INTO {t} (id, v, n) VALUES (3, 'b', 0)")
    # When the page is sent but its commit fails, and the next tick reads it again
    store.fail_next_commit()
    with pytest.raises(CommitError):
        drain(tables.config, source, store, sink)
    first, sink.accepted[:] = list(sink.accepted), []
    drain(tables.config, MysqlBinlogSource(tables.config), store, sink)
    # Then the page went as two batches, epoch 0 then epoch 1, each event with its batch's epoch
    assert [(epoch, [(e[1], e[2]) for e in events]) for _, epoch, events in _sent(first)] == [
        (0, [(0, 9), (0, 9)]),
        (1, [(1, 0), (1, 0)]),
    ]
    # And the re-send is the same batches, ids and epochs (computed from the committed checkpoint only)
    assert _sent(sink.accepted) == _sent(first)
    snap = store.load()
    assert snap is not None
    order = Order.of(snap.doc.checkpoint.metadata)
    assert order.epoch == 1 and order.last == first[-1].events[-1].cursor
    assert snap.doc.checkpoint.metadata[ORDER]["epoch"] == 1
    # And later changes whose cursors grow stay in epoch 1 (equal or greater cursors never bump it)
    sink.accepted.clear()
    _in_domain(tables, 0, "DELETE FROM {t} WHERE id = 2")
    drain(tables.config, source, store, sink)
    assert [b.epoch for b in sink.accepted] == [1] and sink.accepted[0].events[0].change == "delete"


def test_an_epoch_starts_at_a_lower_or_incomparable_cursor_never_at_an_equal_one() -> None:
    # Given cursors after a last one sent: a tie (a keyset tie), a rise, a fall, a rise, another shape
    starts, last = epoch_starts([5, 5, 7, 3, 4, (1, 2)], 5)
    # Then a new epoch starts at the fall and at the other shape only
    assert (starts, last) == ([3, 5], (1, 2))
    assert epoch_starts([1, 2], None) == ([], 2)  # nothing sent yet: nothing to regress from
    # And the order round-trips through a checkpoint's metadata (its last cursor with its type)
    order = Order(2, ("3f0c-uuid", 2**60, 1))
    assert Order.of({ORDER: order.note()}) == order
    assert Order.of({}) == Order() and Order().note() is None

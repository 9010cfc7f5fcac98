"""kind = "mysql_binlog": the row path that turns the binlog's changes into source rows.

The source's row maker works out the checkpoint's cursor and tiebreaker and the event cursor's
head once per transaction (the catch-up's hot path); each row must still carry exactly what its
own :class:`BinlogPosition` gives (the reference forms), whatever the transactions' kinds, however
their changes follow one another, and with the snapshot state it is given. No server: the
changes are made here.
"""

from __future__ import annotations

import datetime as dt

import pytest

from poller.sources.mysql_binlog.position import BinlogPosition
from poller.sources.mysql_binlog.reader import BinlogChange
from poller.sources.mysql_binlog.rows import RowMaker
from shared.errors import SourceError
from shared.models import SnapshotState

AT = dt.datetime(2026, 11, 26, 12, 0, tzinfo=dt.UTC)
STATE = SnapshotState(id="run1", tables=("shop.orders",), chunk_size=100, started_at=AT)

TXNS = (
    BinlogPosition.at("binlog.000003", 777, gtid="0-1-42", gtid_state="0-1-41"),  # MariaDB
    BinlogPosition.at("binlog.000003", 9000, gtid="0-1-43", gtid_state="0-1-42"),
    BinlogPosition.at("binlog.000004", 4),  # no GTID: coordinates
    BinlogPosition.at("binlog.000004", 120, gtid="3e11fa47-71ca-11e1-9e33-c80aa9429562:23"),  # MySQL
)


def _changes() -> list[BinlogChange]:
    out = []
    for n, txn in enumerate(TXNS):
        for seq in range(3):
            row = {"id": n * 10 + seq, "v": f"r{seq}"}
            kind = ("insert", "update", "delete")[seq]
            before = None if kind == "insert" else {**row, "v": "old"}
            after = None if kind == "delete" else row
            out.append(BinlogChange(txn, seq, kind, "shop.orders", ("id",), before, after, AT))  # type: ignore[arg-type]
    return out


def test_each_row_carries_its_own_position_cursor_images_and_state() -> None:
    # Given changes of four transactions (GTIDs of MariaDB and MySQL, and none), three each
    changes = _changes()
    # When one row maker turns them into rows, a snapshot's state on every other one
    make = RowMaker()
    states = [STATE if i % 2 else None for i in range(len(changes))]
    rows = [make(c, state) for c, state in zip(changes, states, strict=True)]
    # Then each row has what its own position gives, not its transaction's or a neighbour's
    for change, state, row in zip(changes, states, rows, strict=True):
        position = change.txn.with_seq(change.seq)
        assert position == change.position == change.key
        reference = position.to_position()
        assert (row.position.cursor, row.position.pk, row.position.snapshot) == (reference.cursor, reference.pk, state)
        assert list(row.position.pk) == list(reference.pk)  # the order the checkpoint is written in
        assert row.event is not None
        assert row.event.cursor == position.event_cursor()
        image = change.before if change.kind == "delete" else change.after
        assert image is not None
        assert row.event.pk == {"id": image["id"]}
        assert (row.event.change, row.event.before, row.event.table) == (change.kind, change.before, "shop.orders")
        assert row.event.committed_at == AT
        assert row.deleted == (change.kind == "delete")
        assert row.values == (change.after or {})
    # And a row read back from its checkpoint is where its change was
    assert [BinlogPosition.from_position(r.position) for r in rows] == [c.position for c in changes]


def test_a_composite_key_is_read_column_by_column() -> None:
    # Given a change of a table keyed on two columns, after one with a single-column key
    make = RowMaker()
    make(BinlogChange(TXNS[0], 0, "insert", "shop.orders", ("id",), None, {"id": 1, "v": "a"}, AT))
    lines = BinlogChange(TXNS[0], 1, "update", "shop.lines", ("order_id", "line"), {"order_id": 1, "line": 2},
                         {"order_id": 1, "line": 3}, AT)  # fmt: skip
    # When it becomes a row, then its key has both columns of its new image
    row = make(lines)
    assert row.event is not None and row.event.pk == {"order_id": 1, "line": 3}


def test_a_change_without_its_key_column_names_it() -> None:
    # Given an update whose image lacks the configured key column
    change = BinlogChange(TXNS[0], 5, "update", "shop.orders", ("sku",), {"id": 1}, {"id": 1}, AT)
    # When it becomes a row, then the error names the change and the missing column
    with pytest.raises(SourceError, match=r"update on shop\.orders at .* row 5 lacks key column\(s\) \['sku'\]"):
        RowMaker()(change)

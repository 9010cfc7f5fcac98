"""The spool a huge transaction is paged from (poller/sources/pg_logical/spool.py): pure, hand-made pgoutput messages.

What the pages of a spooled transaction must keep: every change after any position, in order,
with its transaction's end LSN and the last one marked, whether the read starts at the spool's
beginning or at a seek point mid-transaction (after a Relation message changed, too).
"""

from __future__ import annotations

import struct
from typing import Any

from poller.sources.pg_logical.spool import MARK_EVERY, Spool


def _begin(commit_lsn: int, xid: int) -> bytes:
    return b"B" + struct.pack(">QqI", commit_lsn, 0, xid)


def _relation(oid: int, *columns: str) -> bytes:
    body = struct.pack(">I", oid) + b"public\0t\0d" + struct.pack(">h", len(columns))
    for i, name in enumerate(columns):
        body += struct.pack(">b", 1 if i == 0 else 0) + name.encode() + b"\0" + struct.pack(">Ii", 25, -1)
    return b"R" + body


def _insert(oid: int, *values: str) -> bytes:
    body = struct.pack(">I", oid) + b"N" + struct.pack(">h", len(values))
    for v in values:
        body += b"t" + struct.pack(">i", len(v)) + v.encode()
    return b"I" + body


def _commit(commit_lsn: int, end_lsn: int) -> bytes:
    return b"C" + struct.pack(">bQQq", 0, commit_lsn, end_lsn, 0)


def _load(oid: int, data: bytes) -> Any:
    return data.decode()


BIG = 2 * MARK_EVERY + 500  # three seek points inside the big transaction


def _spool() -> Spool:
    """A small transaction (2 rows), then a big one whose table gains a column midway."""
    spool = Spool()
    spool.write_all([_begin(100, 1), _relation(7, "id"), _insert(7, "s0"), _insert(7, "s1"), _commit(100, 101)])
    spool.write(_begin(500, 2))
    for i in range(BIG):
        if i == MARK_EVERY + 10:  # an ALTER TABLE inside the transaction: the Relation is sent again
            spool.write(_relation(7, "id", "extra"))
        spool.write(_insert(7, f"b{i}") if i < MARK_EVERY + 10 else _insert(7, f"b{i}", "x"))
    spool.write(_commit(500, 501))
    spool.finish()
    return spool


def test_a_spooled_transaction_reads_the_same_from_any_position() -> None:
    spool = _spool()
    try:
        assert spool.last_key == (500, BIG - 1) and spool.end_lsn == 501
        everything = list(spool.changes(None, _load))
        # From the start: both transactions, in order, each change with its end LSN, the last marked
        assert [c.key for c in everything] == [(100, 0), (100, 1)] + [(500, i) for i in range(BIG)]
        assert [c.end_lsn for c in everything[:2]] == [101, 101] and {c.end_lsn for c in everything[2:]} == {501}
        assert [c.key for c in everything if c.last_in_txn] == [(100, 1), (500, BIG - 1)]
        assert everything[2 + MARK_EVERY + 10].new == {"id": f"b{MARK_EVERY + 10}", "extra": "x"}
        # From positions on either side of each seek point: the same changes as from the start
        for after in [(100, 1), (500, 0), (500, MARK_EVERY - 1), (500, MARK_EVERY), (500, MARK_EVERY + 11),
                      (500, 2 * MARK_EVERY), (500, BIG - 2)]:  # fmt: skip
            got = [(c.key, c.new, c.end_lsn, c.last_in_txn) for c in spool.changes(after, _load)]
            want = [(c.key, c.new, c.end_lsn, c.last_in_txn) for c in everything if c.key > after]
            assert got == want, after
        # and it covers every position before its last change, not that one
        assert spool.covers(None) and spool.covers((500, BIG - 2)) and not spool.covers((500, BIG - 1))
    finally:
        spool.close()


def test_a_spool_whose_transaction_did_not_end_is_not_finished() -> None:
    spool = Spool()
    try:
        spool.write_all([_begin(100, 1), _relation(7, "id"), _insert(7, "a")])
        assert spool.in_transaction
        spool.write(_commit(100, 101))
        assert not spool.in_transaction
    finally:
        spool.close()

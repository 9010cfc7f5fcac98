"""A binlog row change, and the transaction being read around it."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

from pymysqlreplication.event import MariadbGtidEvent

from poller.sources.mysql_binlog.position import BinlogPosition

__all__ = ["BinlogChange", "ChangeKind", "Txn", "gtid_of", "primary_key"]

ChangeKind = Literal["insert", "update", "delete"]


class BinlogChange(NamedTuple):
    """One row change of a listed table, as the binlog wrote it.

    A named tuple of its transaction's start and its index in it, not a dataclass holding a
    position of its own: one is made per change, and a frozen dataclass (and a position per
    change) cost more than the rest of our per-change work (BENCHMARKS.md, issue 30).
    """

    txn: BinlogPosition  # the transaction's start (seq -1)
    seq: int  # the change's index among the transaction's changes of the listed tables
    kind: ChangeKind
    table: str  # schema.table
    pk: tuple[str, ...]
    before: dict[str, Any] | None  # updates and deletes: the old row (binlog_row_image = FULL)
    after: dict[str, Any] | None  # inserts and updates: the new row
    committed_at: dt.datetime

    @property
    def position(self) -> BinlogPosition:
        return self.txn.with_seq(self.seq)

    @property
    def key(self) -> BinlogPosition:
        """Its position key in the log (the snapshot coordinator's; ordered as the binlog)."""
        return self.txn.with_seq(self.seq)


@dataclass(slots=True)
class Txn:
    """The transaction being read: where it starts, what of it was read before, what it holds."""

    position: BinlogPosition  # seq -1: the transaction's start
    skip_through: int  # rows at or below this index were read before
    standalone: bool
    committed_at: dt.datetime
    seq: int = -1
    xa: bool = False  # an XA transaction's prepared part: its changes wait for XA COMMIT
    xid: str | None = None
    held: list[BinlogChange] = field(default_factory=list)  # an XA part's changes until its prepare
    touched: bool = False  # it changes a listed table
    unknown: int | None = None  # the type of an event in it the library does not decode


def gtid_of(event: Any) -> str | None:
    if isinstance(event, MariadbGtidEvent):
        return str(event.gtid)
    if int(getattr(event, "gno", 0) or 0) <= 0 or not any(event.sid):
        return None  # MySQL's anonymous GTID (gtid_mode = OFF)
    return str(event.gtid)


def primary_key(event: Any) -> tuple[str, ...]:
    key = event.primary_key
    if not key:
        return ()
    return (key,) if isinstance(key, str) else tuple(key)

"""Where a ``kind = "mysql_binlog"`` poller stands in the binlog, and how that is checkpointed.

A change's place is its transaction's start in the binlog (file and offset of the transaction's
first event: its GTID event, or its ``BEGIN``) and its index among the transaction's row changes
of the poller's tables (``seq``). :class:`BinlogPosition` orders them totally (file number, offset,
seq), which is commit order on one server; a coordinator compares positions with ``<``.

The checkpoint keeps the binlog coordinates and, where the server has GTIDs, the transaction's
GTID and the server's GTID state *before* the transaction (MariaDB: ``domain-server-seq`` per
domain, what ``@slave_connect_state`` takes): a resume connects at that state, so the server
sends the checkpoint's transaction first, and the rows at or before ``seq`` are skipped. ``seq``
is -1 for a position between transactions (nothing of the next one delivered yet).

Event ids come from :meth:`BinlogPosition.event_cursor`: the GTID's numbers and ``seq`` (the same
on every read of the change, and on a failover replica), else the coordinates and ``seq``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from shared.errors import SourceError
from shared.models import CursorValue, Position

__all__ = ["BinlogPosition", "GtidState", "file_number"]

_FILE_NUMBER = re.compile(r"\.(\d+)$")
_MARIADB_GTID = re.compile(r"^(\d+)-(\d+)-(\d+)$")


def file_number(name: str) -> int:
    """The sequence number of a binlog file name (``binlog.000042`` → 42)."""
    match = _FILE_NUMBER.search(name)
    if match is None:
        raise SourceError(f"{name!r} is not a binlog file name (name.NNNNNN)")
    return int(match.group(1))


@dataclass(frozen=True, order=True, slots=True)
class BinlogPosition:
    """A change's place in the binlog: ``(file number, transaction start, seq)``, totally ordered.

    ``gtid``: the transaction's GTID (None between transactions, or on a server without GTIDs);
    ``gtid_state``: MariaDB's GTID state before the transaction (where a resume connects).
    """

    file_number: int
    txn_pos: int
    seq: int
    file: str = field(compare=False)
    gtid: str | None = field(default=None, compare=False)
    gtid_state: str | None = field(default=None, compare=False)

    @classmethod
    def at(
        cls, file: str, pos: int, *, seq: int = -1, gtid: str | None = None, gtid_state: str | None = None
    ) -> BinlogPosition:
        return cls(file_number(file), pos, seq, file, gtid, gtid_state)

    def event_cursor(self) -> CursorValue:
        """The event's ``cursor`` (part of its id): the same on every read of this change, and
        ordered like the changes, so a handler may apply a change only if newer than the last.

        MariaDB: ``(domain, GTID seq no, seq)`` (the same on a failover replica); MySQL with a
        GTID: ``(server uuid, gno, seq)``; else ``(file number, transaction offset, seq)``.
        """
        gtid = self.gtid
        if gtid is not None and (match := _MARIADB_GTID.match(gtid)):
            return (int(match.group(1)), int(match.group(3)), self.seq)
        if gtid is not None and ":" in gtid:
            uuid, _, gno = gtid.rpartition(":")
            return (uuid, int(gno), self.seq)
        return (self.file_number, self.txn_pos, self.seq)

    def with_seq(self, seq: int) -> BinlogPosition:
        # Positional, not dataclasses.replace: called once per row change (a tenth of a catch-up's time).
        return BinlogPosition(self.file_number, self.txn_pos, seq, self.file, self.gtid, self.gtid_state)

    # ------------------------------------------------------------------------------ checkpoint form

    def to_position(self) -> Position:
        """The checkpoint form: cursor ``file number << 32 | offset`` (an ordered integer), the
        rest in the tiebreaker (``seq`` first, as the other change-log sources write it)."""
        tiebreaker: dict[str, Any] = {"seq": self.seq, "file": self.file, "pos": self.txn_pos}
        if self.gtid is not None:
            tiebreaker["gtid"] = self.gtid
        if self.gtid_state is not None:
            tiebreaker["gtid_state"] = self.gtid_state
        return Position((self.file_number << 32) | self.txn_pos, tiebreaker)

    @classmethod
    def from_position(cls, position: Position) -> BinlogPosition:
        pk = position.pk
        file, pos, seq = pk.get("file"), pk.get("pos"), pk.get("seq")
        gtid, state = pk.get("gtid"), pk.get("gtid_state")
        if (
            not isinstance(file, str)
            or not isinstance(pos, int)
            or not isinstance(seq, int)
            or not isinstance(gtid, str | None)
            or not isinstance(state, str | None)
        ):
            raise SourceError(
                f"the checkpoint {position.cursor!r}/{dict(pk)} is not a binlog position",
                hint="this checkpoint was written by another source kind: `dbfanout checkpoint reset` the poller",
            )
        return cls.at(file, pos, seq=seq, gtid=gtid, gtid_state=state)

    def __str__(self) -> str:
        where = f"{self.file}:{self.txn_pos}"
        if self.gtid is not None:
            where += f" (GTID {self.gtid})"
        elif self.gtid_state is not None:
            where += f" (after GTID state {self.gtid_state})"
        return where + (f" row {self.seq}" if self.seq >= 0 else "")


class GtidState:
    """MariaDB's GTID state: the last GTID of each replication domain (``0-1-42,1-2-7``)."""

    __slots__ = ("_last",)

    def __init__(self, text: str = "") -> None:
        self._last: dict[int, tuple[int, int]] = {}  # domain -> (server id, seq no)
        for part in filter(None, (p.strip() for p in text.split(","))):
            self.add(part)

    def add(self, gtid: str) -> None:
        """``gtid`` was read: the state moves to it (never back: a re-sent GTID leaves it)."""
        domain, server, seq = _parse(gtid)
        last = self._last.get(domain)
        if last is None or seq > last[1]:
            self._last[domain] = (server, seq)

    def covers(self, gtid: str) -> bool:
        """Whether ``gtid`` is at or before this state's position in its domain."""
        domain, _, seq = _parse(gtid)
        last = self._last.get(domain)
        return last is not None and seq <= last[1]

    def copy(self) -> GtidState:
        clone = GtidState()
        clone._last = dict(self._last)
        return clone

    def __str__(self) -> str:
        return ",".join(f"{d}-{s}-{n}" for d, (s, n) in sorted(self._last.items()))


def _parse(gtid: str) -> tuple[int, int, int]:
    match = _MARIADB_GTID.match(gtid)
    if match is None:
        raise SourceError(f"{gtid!r} is not a MariaDB GTID (domain-server-seq)")
    return int(match.group(1)), int(match.group(2)), int(match.group(3))

"""Reads a MySQL/MariaDB row-based binlog as a replica does, into row changes with their positions.

The replication protocol and the row-event decoding are the ``mysql-replication`` package's
(``pymysqlreplication``, an optional extra: this module is imported only by a running
``kind = "mysql_binlog"`` poller). This module adds what a checkpointed, at-least-once reader
needs on top:

* **transactions**: each row change gets its transaction's start and its index in it
  (:class:`~poller.sources.mysql_binlog.position.BinlogPosition`), so a page may end anywhere inside a
  large transaction and a resume skips exactly what was delivered;
* **where to start**: MariaDB by GTID state (``@slave_connect_state``: the server sends the
  checkpoint's transaction first, on this server or a failover replica); MySQL by binlog file and
  offset, always with ``resume_stream=True`` (the library's default starts at the file's offset
  4, re-sending the whole file before the checkpoint);
* **the library's re-sends are absorbed**: on a dropped connection it reconnects by itself, from
  the GTID state it was *opened* with (or mid-transaction by coordinates). A transaction this
  reader already read is skipped (GTID state, or coordinates at or before the last one read); a
  stream that restarts inside a transaction is an error (the source re-reads from its checkpoint).
* **columns as they were**: names and the primary key come from each table map event's own
  metadata (``binlog_row_metadata = FULL``), never from ``information_schema``: a change is
  labelled with its table's columns at the time it was written, whatever ALTER TABLE came since.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

from pymysqlreplication import BinLogStreamReader
from pymysqlreplication.event import (
    GtidEvent,
    HeartbeatLogEvent,
    MariadbGtidEvent,
    QueryEvent,
    RotateEvent,
    XidEvent,
)
from pymysqlreplication.row_event import (
    DeleteRowsEvent,
    UpdateRowsEvent,
    WriteRowsEvent,
)

from poller.sources.mysql_binlog.position import BinlogPosition, GtidState, file_number
from poller.sources.mysql_binlog.values import fix_rows
from shared.errors import FetchError, SourceError

__all__ = ["BinlogChange", "BinlogReader", "ChangeKind"]

ChangeKind = Literal["insert", "update", "delete"]

_ROW_EVENTS = (WriteRowsEvent, UpdateRowsEvent, DeleteRowsEvent)
#: Seconds of silence after which the server sends a heartbeat: a read that has not met the end it
#: was opened for (an event the server does not send) ends then, as caught up.
HEARTBEAT_SECONDS = 0.5
_MARIADB_STANDALONE = 0x01  # a GTID event's flag: the transaction is one statement (DDL), no XID follows
_UNSEEN = -2  # a transaction's rows are all new
_ALL = 1 << 62  # a transaction's rows were all read before


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
class _Txn:
    position: BinlogPosition  # seq -1: the transaction's start
    skip_through: int  # rows at or below this index were read before
    standalone: bool
    committed_at: dt.datetime
    seq: int = -1


class BinlogReader:
    """One replication stream from a start position to ``until``, the binlog's end when it was opened.

    ``read`` returns up to ``limit`` changes of the listed tables after the start; call it again
    for more (the stream stays open); ``at_end`` once the stream reached ``until`` (or the server
    sent a heartbeat: nothing more to send). ``position`` is where the stream stands between
    transactions (everything before it read).

    The stream is a *blocking* dump read only up to ``until``: a non-blocking dump ends with the
    server closing the connection once it has sent everything, and a client still decoding the
    events it buffered then loses them to the connection reset (seen with a few hundred KB of
    binlog on MariaDB 10.11); a blocking dump stays open until this reader closes it.
    """

    def __init__(
        self,
        connection: Mapping[str, Any],
        server_id: int,
        tables: frozenset[str],
        start: BinlogPosition,
        until: tuple[str, int],
        *,
        by_gtid: bool,
        pk: tuple[str, ...] = (),
    ) -> None:
        self._tables = tables
        self._pk = pk
        self._start = start
        self._by_gtid = by_gtid and start.gtid_state is not None
        self._state = GtidState(start.gtid_state or "") if self._by_gtid else None
        self._txn: _Txn | None = None
        self._last_txn: BinlogPosition | None = None  # the last transaction read whole (coordinates)
        self._file = start.file
        # Between transactions: where the next page starts when this stream finds no row.
        self.position = BinlogPosition.at(start.file, start.txn_pos, gtid_state=start.gtid_state)
        self.handed: BinlogPosition | None = None  # the last change read returned
        self.at_end = False
        self._until = (file_number(until[0]), until[1])
        self._pos = 0  # the end offset of the last event read in self._file
        schemas = sorted({t.partition(".")[0] for t in tables})
        names = sorted({t.partition(".")[2] for t in tables})
        options: dict[str, Any] = {
            "connection_settings": dict(connection),
            "server_id": server_id,
            "blocking": True,
            "slave_heartbeat": HEARTBEAT_SECONDS,
            # Every event type the library knows, not only those read here: the stream must hand
            # over the binlog's last event whatever it is (a binlog checkpoint, a GTID list) for
            # the read to see that it reached ``until`` (a filtered one is skipped inside the
            # library, which then blocks for the next event: a heartbeat's wait).
            "only_events": None,
            # Other tables cost next to nothing: the library drops their table maps after the
            # name and their row events at the table id, never decoding a row (row decoding is
            # lazy, on ``.rows``). Event types read for nothing are one small object per
            # transaction, not per row (BENCHMARKS.md, issue 30).
            "only_schemas": schemas,
            "only_tables": names,
            "enable_logging": False,
            "resume_stream": True,
        }
        if self._by_gtid:
            options.update(is_mariadb=True, auto_position=start.gtid_state)
        else:
            options.update(log_file=start.file, log_pos=start.txn_pos)
        self._stream = BinLogStreamReader(**options)
        self._rows: list[BinlogChange] = []
        self._resent: dict[str, int] = {}  # GTID -> rows read of it when the library reconnected
        self._connected = False
        self.restarts = 0  # reconnections the library made by itself (its re-sends are skipped)

    def close(self) -> None:
        self._stream.close()

    def extend(self, until: tuple[str, int]) -> None:
        """Read on to ``until`` (a later binlog end) after ``at_end``: the blocking stream is still open."""
        self._until = (file_number(until[0]), until[1])
        self.at_end = False

    @property
    def drained(self) -> bool:
        """Read to ``until`` and every change read handed out (``at_end`` may hold rows still)."""
        return self.at_end and not self._rows

    @property
    def end(self) -> tuple[str, int]:
        """The binlog coordinates the stream read to (``until`` once ``at_end``)."""
        return self._file, self._pos

    def read(self, limit: int) -> list[BinlogChange]:
        """Up to ``limit`` changes after the last one returned (fewer: the end of the binlog)."""
        out: list[BinlogChange] = []
        while len(out) < limit:
            if self._rows:
                take = self._rows[: limit - len(out)]
                del self._rows[: len(take)]
                out.extend(take)
                continue
            if self.at_end:
                break
            event = self._stream.fetchone()
            if event is None or isinstance(event, HeartbeatLogEvent):
                self.at_end = True  # the server has nothing more to send
                if event is not None and self._txn is None and event.packet.log_pos:
                    self._pos = int(event.packet.log_pos)  # where its binlog ends: an idle check compares it
                break
            self._event(event)
            if self._txn is None and (file_number(self._file), self._pos) >= self._until:
                self.at_end = True
        if out:
            self.handed = out[-1].position
        return out

    # ------------------------------------------------------------------------------ events

    def _event(self, event: Any) -> None:
        if isinstance(event, RotateEvent):
            self._rotated(event)
            return
        if event.packet.log_pos:
            self._pos = int(event.packet.log_pos)
        start = int(event.packet.log_pos) - int(event.packet.event_size)  # where this event begins
        if isinstance(event, MariadbGtidEvent | GtidEvent):
            self._begin(event, start)
        elif isinstance(event, QueryEvent):
            self._query(event, start)
        elif isinstance(event, XidEvent):
            self._commit(int(event.packet.log_pos))
        elif isinstance(event, _ROW_EVENTS):
            self._rows_of(event)

    def _rotated(self, event: Any) -> None:
        """A new binlog file, or (timestamp 0, after the first) the library reconnected by itself."""
        if event.timestamp == 0:
            self.restarts += 1 if self._connected else 0
            self._connected = True
        txn, self._file, self._pos = self._txn, event.next_binlog, int(event.position)
        if txn is None:
            return
        # The stream restarted inside a transaction (a binlog never rotates inside one).
        if txn.position.gtid is None or self._state is None:
            raise FetchError(f"the binlog stream restarted inside the transaction at {txn.position}")
        # By GTID the server sends it again from its start: skip what was read of it.
        self._resent[txn.position.gtid] = max(txn.seq, txn.skip_through)
        self._txn = None

    def _begin(self, event: Any, start: int) -> None:
        if self._txn is not None:  # ended without an XID or COMMIT we know: it is over
            self._commit(start)
        gtid = _gtid_of(event)
        state = str(self._state) if self._state is not None else None
        position = BinlogPosition.at(self._file, start, gtid=gtid, gtid_state=state)
        standalone = isinstance(event, MariadbGtidEvent) and bool(event.flags & _MARIADB_STANDALONE)
        at = dt.datetime.fromtimestamp(event.timestamp, dt.UTC)
        self._txn = _Txn(position, self._skip_through(position), standalone, at)

    def _query(self, event: Any, start: int) -> None:
        query = event.query.strip().upper() if isinstance(event.query, str) else ""
        if query == "BEGIN":
            if self._txn is None:  # no GTID event before it (MySQL with gtid_mode = OFF and no anonymous GTID)
                position = BinlogPosition.at(self._file, start)
                at = dt.datetime.fromtimestamp(event.timestamp, dt.UTC)
                self._txn = _Txn(position, self._skip_through(position), False, at)
            return
        if self._txn is not None and (query == "COMMIT" or self._txn.standalone):
            self._commit(int(event.packet.log_pos))  # COMMIT: non-transactional tables; else DDL

    def _commit(self, end: int) -> None:
        txn, self._txn = self._txn, None
        if txn is None:
            return
        if self._state is not None and txn.position.gtid is not None:
            self._state.add(txn.position.gtid)
        if txn.skip_through != _ALL:
            self._last_txn = txn.position
        state = str(self._state) if self._state is not None else None
        # Between transactions: the next one starts here (a checkpoint here skips nothing of it).
        self.position = BinlogPosition.at(self._file, end, gtid_state=state)

    def _skip_through(self, position: BinlogPosition) -> int:
        """The highest index of ``position``'s transaction that was read before (-2: none)."""
        gtid, start = position.gtid, self._start
        if gtid is not None and gtid in self._resent:
            return self._resent.pop(gtid)  # read in part before the library reconnected
        if self._state is not None and gtid is not None and self._state.covers(gtid):
            return _ALL  # read whole before (the library re-sends from the state it was opened with)
        last, key = self._last_txn, (position.file_number, position.txn_pos)
        if self._state is None and last is not None and key <= (last.file_number, last.txn_pos):
            return _ALL  # the library re-sent a transaction read before
        if start.gtid is not None and gtid == start.gtid:
            return start.seq  # the checkpoint's transaction
        if self._state is not None:
            return _UNSEEN
        begun = (start.file_number, start.txn_pos)
        if key < begun:
            return _ALL
        return start.seq if key == begun else _UNSEEN

    def _rows_of(self, event: Any) -> None:
        txn = self._txn
        if txn is None:
            raise FetchError(f"the binlog stream resumed inside a transaction (at {self._file}:{event.packet.log_pos})")
        table = f"{event.schema}.{event.table}"
        if table not in self._tables:
            return
        names = [c.name for c in event.columns]
        if any(n is None for n in names):
            raise SourceError(
                f"the binlog at {self._file}:{event.packet.log_pos} has no column names for {table}",
                hint="set binlog_row_metadata = FULL on the server (MariaDB 10.5+, MySQL 8.0.1+); "
                "changes written before that cannot be labelled: reset the checkpoint after setting it",
            )
        pk = self._pk or _primary_key(event)
        if not pk:
            raise SourceError(
                f"table {table} has no primary key (binlog at {self._file}:{event.packet.log_pos})",
                hint="add a primary key, or set pk to the columns that identify a row",
            )
        if txn.skip_through == _ALL:
            return  # a transaction read whole before (re-sent by the library): its rows are not decoded
        rows = fix_rows(event.columns, event.rows)  # values as keyset reads them (docs/types.md)
        first = txn.seq + 1  # the index of the event's first row in its transaction
        txn.seq += len(rows)
        if txn.skip_through >= first:
            rows = rows[txn.skip_through - first + 1 :]  # read before this stream: skipped
            first = txn.skip_through + 1
        # One positional tuple per change, the loop per event type (no per-row branch).
        start, at, make = txn.position, txn.committed_at, BinlogChange
        if isinstance(event, UpdateRowsEvent):
            changes = [
                make(start, s, "update", table, pk, r["before_values"], r["after_values"], at)
                for s, r in enumerate(rows, first)
            ]
        elif isinstance(event, WriteRowsEvent):
            changes = [make(start, s, "insert", table, pk, None, r["values"], at) for s, r in enumerate(rows, first)]
        else:
            changes = [make(start, s, "delete", table, pk, r["values"], None, at) for s, r in enumerate(rows, first)]
        self._rows.extend(changes)


def _gtid_of(event: Any) -> str | None:
    if isinstance(event, MariadbGtidEvent):
        return str(event.gtid)
    if int(getattr(event, "gno", 0) or 0) <= 0 or not any(event.sid):
        return None  # MySQL's anonymous GTID (gtid_mode = OFF)
    return str(event.gtid)


def _primary_key(event: Any) -> tuple[str, ...]:
    key = event.primary_key
    if not key:
        return ()
    return (key,) if isinstance(key, str) else tuple(key)

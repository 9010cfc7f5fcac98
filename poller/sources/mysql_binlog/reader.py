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
  labelled with its table's columns at the time it was written, whatever ALTER TABLE came since;
  ``BINARY(n)`` values, which the binlog writes without their trailing ``0x00`` bytes, are padded
  back to ``n`` from the table map (a key arrives as stored, and as a snapshot reads it);
* **every event understood or an error**: compressed events decompressed (compressed.py); an
  unknown one in a transaction of a listed table, or a statement-format change of one
  (statements.py), stops the read before it; a TRUNCATE is recorded (:attr:`BinlogReader.truncated`);
* **XA**: rows delivered at ``XA COMMIT``, never after ``XA ROLLBACK`` (xa.py).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from typing import Any

from pymysqlreplication import BinLogStreamReader
from pymysqlreplication.event import (
    ExecuteLoadQueryEvent,
    GtidEvent,
    HeartbeatLogEvent,
    MariadbGtidEvent,
    NotImplementedEvent,
    QueryEvent,
    RotateEvent,
    XAPrepareEvent,
    XidEvent,
)
from pymysqlreplication.row_event import (
    DeleteRowsEvent,
    PartialUpdateRowsEvent,
    UpdateRowsEvent,
    WriteRowsEvent,
)

from poller.sources.mysql_binlog import compressed, statements
from poller.sources.mysql_binlog.change import BinlogChange, ChangeKind, Txn, gtid_of, primary_key
from poller.sources.mysql_binlog.position import BinlogPosition, GtidState, file_number
from poller.sources.mysql_binlog.rows import binary_widths, pad_binary
from poller.sources.mysql_binlog.values import fix_rows
from poller.sources.mysql_binlog.xa import XaHold, xa_statement
from shared.errors import FetchError, SourceError

__all__ = ["BinlogChange", "BinlogReader", "ChangeKind"]

_ROW_EVENTS = (WriteRowsEvent, UpdateRowsEvent, DeleteRowsEvent)
#: Seconds of silence after which the server sends a heartbeat: a read that has not met the end it
#: was opened for (an event the server does not send) ends then, as caught up.
HEARTBEAT_SECONDS = 0.5
_MARIADB_STANDALONE = 0x01  # a GTID event's flag: the transaction is one statement (DDL), no XID follows
_MARIADB_PREPARED_XA = 0x40  # a GTID event's flag: an XA transaction's prepared part (XA START .. XA PREPARE)
_UNSEEN = -2  # a transaction's rows are all new
_ALL = 1 << 62  # a transaction's rows were all read before


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
        self._txn: Txn | None = None
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
            # Events it does not decode are handed over too: each is understood here or an error.
            "filter_non_implemented_events": False,
        }
        if self._by_gtid:
            options.update(is_mariadb=True, auto_position=start.gtid_state)
        else:
            options.update(log_file=start.file, log_pos=start.txn_pos)
        self._stream = BinLogStreamReader(**options)
        self._rows: list[BinlogChange] = []
        self._xa = XaHold()
        #: ``(table, position)`` of each TRUNCATE of a listed table read (the source warns and records it).
        self.truncated: list[tuple[str, BinlogPosition]] = []
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
        elif isinstance(event, XAPrepareEvent):
            self._xa_prepared(event)
        elif isinstance(event, NotImplementedEvent):
            self._undecoded(event, start)
        elif isinstance(event, ExecuteLoadQueryEvent):  # LOAD DATA in statement format: no rows
            schema, query = statements.load_statement(compressed.event_body(self._stream, event.packet))
            self._unknown(int(event.packet.event_type))
            if error := statements.dml_error(query, schema, self._tables, f"{self._file}:{start}"):
                raise error
        elif not isinstance(event, (*statements.PASSED, HeartbeatLogEvent)):
            self._unknown(int(event.packet.event_type))

    def _undecoded(self, event: Any, start: int) -> None:
        """An event the library does not decode: decompressed, skipped when it carries no change,
        else an error once its transaction changes a listed table (compressed.py)."""
        kind = compressed.unknown_kind(event.packet, f"{self._file}:{start}")
        if kind is None:
            plain = compressed.decompress(self._stream, event.packet)
            if plain is not None and not isinstance(plain, NotImplementedEvent):
                self._event(plain)
        elif kind >= 0:
            self._unknown(kind)

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
        gtid = gtid_of(event)
        state = str(self._state) if self._state is not None else None
        position = BinlogPosition.at(self._file, start, gtid=gtid, gtid_state=state)
        mariadb = isinstance(event, MariadbGtidEvent)
        standalone = mariadb and bool(event.flags & _MARIADB_STANDALONE)
        at = dt.datetime.fromtimestamp(event.timestamp, dt.UTC)
        self._txn = Txn(position, self._skip_through(position), standalone, at)
        self._txn.xa = mariadb and bool(event.flags & _MARIADB_PREPARED_XA)

    def _query(self, event: Any, start: int) -> None:
        query = event.query.strip().upper() if isinstance(event.query, str) else ""
        xa = query.startswith("XA ")
        if query == "BEGIN" or xa:
            if self._txn is None:  # no GTID event before it (MySQL with gtid_mode = OFF: an anonymous GTID)
                position = BinlogPosition.at(self._file, start)
                at = dt.datetime.fromtimestamp(event.timestamp, dt.UTC)
                self._txn = Txn(position, self._skip_through(position), False, at)
            if xa:
                self._xa_statement(event.query, int(event.packet.log_pos))
            return
        if query.startswith(("TRUNCATE", "INSERT", "UPDATE", "DELETE", "REPLACE", "LOAD", "/*")):
            self._statement(event, event.query, start)
        if self._txn is not None and (query == "COMMIT" or self._txn.standalone):
            self._commit(int(event.packet.log_pos))  # COMMIT: non-transactional tables; else DDL

    def _xa_statement(self, query: str, end: int) -> None:
        statement, txn = xa_statement(query), self._txn
        if statement is None or txn is None:
            return  # not an XA statement we know (XA RECOVER is not binlogged)
        verb, xid, one_phase = statement
        if verb in ("START", "END"):  # MySQL writes XA START as a statement; MariaDB flags the GTID
            txn.xa, txn.xid = True, xid
            return
        if txn.xa and one_phase:  # XA COMMIT ... ONE PHASE inside the transaction: committed now
            txn.xa = False
            self._emit(txn.held)
        elif txn.skip_through != _ALL:  # the outcome of a transaction prepared before (not a re-send)
            released = self._xa.resolve(xid, verb == "COMMIT")
            if released is not None:
                self._rows.extend(released)
        self._commit(end)

    def _xa_prepared(self, event: Any) -> None:
        """XA PREPARE (MySQL: or XA COMMIT ONE PHASE): the prepared part ends here."""
        txn = self._txn
        if txn is not None and txn.held and txn.skip_through != _ALL:
            if getattr(event, "one_phase", False):
                self._emit(txn.held)
            else:
                self._xa.prepared(txn.xid or "", txn.held)
        self._commit(int(event.packet.log_pos))

    def _emit(self, changes: list[BinlogChange]) -> None:
        """Committed changes: handed out, or held behind a prepared XA transaction with no outcome yet."""
        if self._xa.holding:
            self._xa.add(changes)
        else:
            self._rows.extend(changes)

    def _statement(self, event: Any, query: str, start: int) -> None:
        """A TRUNCATE of a listed table is recorded; a statement-format change of one is an error."""
        txn, schema = self._txn, statements.schema_of(event)
        table = statements.truncated_table(query, schema)
        if table is not None and table in self._tables and (txn is None or txn.skip_through != _ALL):
            self.truncated.append((table, txn.position if txn is not None else BinlogPosition.at(self._file, start)))
        error = statements.dml_error(query, schema, self._tables, f"{self._file}:{start}")
        if error is not None:
            raise error

    def _unknown(self, kind: int) -> None:
        """An event the reader does not know: an error once its transaction changes a listed table."""
        if self._txn is not None:
            self._txn.unknown = kind
            if self._txn.touched:
                raise compressed.unknown_error(self._txn.position, kind)

    def _commit(self, end: int) -> None:
        txn, self._txn = self._txn, None
        if txn is None:
            return
        if self._state is not None and txn.position.gtid is not None:
            self._state.add(txn.position.gtid)
        if txn.skip_through != _ALL:
            self._last_txn = txn.position
        state = str(self._state) if self._state is not None else None
        # Between transactions: the next one starts here (a checkpoint here skips nothing of it),
        # unless changes are held behind a prepared XA transaction: then before it (see xa.py).
        if not self._xa.holding:
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
        pk = self._pk or primary_key(event)
        if not pk:
            raise SourceError(
                f"table {table} has no primary key (binlog at {self._file}:{event.packet.log_pos})",
                hint="add a primary key, or set pk to the columns that identify a row",
            )
        txn.touched = True
        if txn.unknown is not None or isinstance(event, PartialUpdateRowsEvent):  # MySQL's JSON diffs: no full row
            raise compressed.unknown_error(txn.position, txn.unknown or compressed.PARTIAL_UPDATE_ROWS)
        if txn.skip_through == _ALL:
            return  # a transaction read whole before (re-sent by the library): its rows are not decoded
        rows = fix_rows(event.columns, event.rows)  # values as keyset reads them (docs/types.md)
        padded = binary_widths(event)
        if padded:  # BINARY(n) keys and values whole: the binlog strips their trailing 0x00
            pad_binary(rows, padded)
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
        if txn.xa:
            txn.held.extend(changes)
        else:
            self._emit(changes)

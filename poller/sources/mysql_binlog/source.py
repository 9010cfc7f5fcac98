"""The ``kind = "mysql_binlog"`` source: every change, hard deletes included, from the row-based binlog.

MySQL and MariaDB write every committed row change to the binary log when ``binlog_format = ROW``
(Azure Database for MySQL Flexible Server always does). This source reads it as a replica does,
through the ``mysql-replication`` package (the extra ``dbfanout[mysql-binlog]``; see
:mod:`poller.sources.mysql_binlog.reader`), and delivers inserts, updates (before and after images) and
deletes of the poller's tables in commit order, as the pg_logical source does.

The tick's order keeps the at-least-once contract:

1. ``fetch`` opens a replication stream at the checkpoint (MariaDB: its GTID state; MySQL: its
   binlog file and offset), read up to the binlog's end as of then, skips what the checkpoint
   covers (a transaction's rows up to its ``seq``), and returns up to a page of changes; the next
   fetch of the tick goes on reading the same stream (a large transaction spans pages and ticks);
2. the tick sends the page (event ids from the GTID and ``seq``: re-sends are duplicates);
3. the tick commits the checkpoint (CAS, fencing); nothing needs acknowledging: the server keeps
   the binlog for its retention time, not for this reader (``dbfanout validate`` checks it).

The first fetch without a checkpoint starts at the binlog's end at that moment: changes committed
after a poller's first tick are delivered; with ``snapshot = "initial"`` that first checkpoint
carries a snapshot of every table, which then runs beside the stream.

Snapshots (``snapshot = "initial"``, ``dbfanout snapshot``) are DBLog's, run by the same
coordinator as the pg_logical source's (:class:`~poller.snapshot.coordinator.SnapshotCoordinator`):
this source is the log reader it walks (position keys: :class:`BinlogPosition`), and
:class:`~poller.snapshot.mysql.MysqlChunkReader` its chunk SQL (a committed barrier, then the
chunk in a consistent snapshot with its high watermark). The signal table lives in the source
database; its rows come through the binlog in order with the changes (requests, watermarks).

Cost while idle: a stream is opened only when the binlog moved since the last read reached its
end; an idle fetch is one ``SHOW MASTER STATUS`` on a pooled connection (no replication
connection). A stream costs two connections (the replication one and the library's control one)
and stays open until the tick ends: a lingering tick's next fetches read on from it.

Read-ahead (:mod:`poller.tick.prefetch`) is supported but off (see ``prefetch_pages``: measured
no faster): with it, after a tick's first page the stream would be read and its rows decoded on
the tick's reader thread while the tick sends the previous page; not while a snapshot runs. A
fetch from a position the stream is not at (a page read ahead of a tick that stopped was dropped)
opens a stream there: nothing is skipped.
"""

from __future__ import annotations

import datetime as dt
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, suppress
from typing import Any

import sqlalchemy as sa

from poller.ports import Page, SourceRow
from poller.snapshot.contracts import ChunkSource, LogRead, Signal
from poller.snapshot.coordinator import SnapshotCoordinator
from poller.snapshot.mysql import MysqlChunkReader, signal_table
from poller.snapshot.requests import signal_of
from poller.sources.engines import require_driver, source_engine
from poller.sources.mysql_binlog.position import BinlogPosition, file_number
from poller.sources.mysql_binlog.rows import RowMaker, text_values
from poller.sources.mysql_binlog.server import binlog_end, binlog_errors
from poller.sources.mysql_binlog.truncates import TruncateLog
from shared.config import PollerConfig
from shared.errors import ConfigError, SourceError
from shared.ids import source_fingerprint
from shared.logs import get_logger
from shared.models import Checkpoint, CursorValue, Position, SnapshotState
from shared.settings import fingerprint_url, redact_url

__all__ = ["MysqlBinlogSource", "qualified_tables", "table_qualifier"]

log = get_logger("poller.mysql_binlog")

#: Bytes of binlog read past the checkpoint with no change of the poller's tables after which an
#: empty page still moves the checkpoint (so a poller of a quiet table is not left on a binlog
#: file the server may purge, and a resume does not re-read the other tables' traffic).
ADVANCE_BYTES = 1 << 20


def qualified_tables(config: PollerConfig, database: str | None) -> frozenset[str]:
    """The poller's tables as ``schema.table`` (an unqualified name is in the URL's database)."""
    out = set()
    for table in config.tables:
        if "." not in table and not database:
            raise ConfigError(
                f"pollers.{config.name}.tables",
                f"{table!r} has no schema and the source_url names no database",
                hint='name it "shop.orders", or put the database in the URL (mysql+pymysql://user@host/shop)',
            )
        out.add(table if "." in table else f"{database}.{table}")
    return frozenset(out)


def table_qualifier(config: PollerConfig) -> Callable[[str], str]:
    """How the binlog names a table of the poller: ``orders`` is ``<the URL's database>.orders``."""
    database = sa.make_url(config.source_url).database

    def qualify(table: str) -> str:
        return table if "." in table else f"{database}.{table}"

    return qualify


class MysqlBinlogSource:
    """The :class:`~poller.ports.Source` port over a MySQL/MariaDB row-based binlog."""

    def __init__(self, config: PollerConfig, engine: sa.Engine | None = None) -> None:
        key = f"pollers.{config.name}"
        if config.kind != "mysql_binlog":
            raise ConfigError(f"{key}.kind", 'MysqlBinlogSource needs kind = "mysql_binlog"')
        require_driver("pymysql", key, 'kind = "mysql_binlog"', label="pymysql")
        # The replication package is optional too: checked (not imported) only when such a poller opens.
        require_driver("pymysqlreplication", key, 'kind = "mysql_binlog"', label="mysql-replication")
        self._config = config
        self._engine = source_engine(config, engine)
        if self._engine.dialect.name not in ("mysql", "mariadb"):
            raise ConfigError(
                f"{key}.kind", f'kind = "mysql_binlog" needs MySQL 8.0+ or MariaDB 10.5+ (this source is '
                f"{self._engine.dialect.name})",
            )  # fmt: skip
        self._url = redact_url(config.source_url)
        self._tables = qualified_tables(config, sa.make_url(config.source_url).database)
        self._qualify = table_qualifier(config)
        self._fingerprint = source_fingerprint(
            {
                "url": fingerprint_url(config.source_url),
                "kind": "mysql_binlog",
                "tables": sorted(self._tables),
                "pk": list(config.pk),
            }
        )
        self._lock = threading.Lock()
        self._pins = 0  # the tick's pin and its read-ahead thread's (the stream closes with the last)
        self._reader: Any = None  # the open BinlogReader (poller.sources.mysql_binlog.reader), if any
        self._row = RowMaker()
        self._stream_at: BinlogPosition | None = None  # the open stream's next read continues after this
        self._idle: tuple[BinlogPosition, tuple[str, int]] | None = None  # read to the end at: (after, end)
        self._mariadb: bool | None = None
        self.streams_opened = 0  # replication streams opened (tests and benchmarks read it)
        self._truncates = TruncateLog(config.name)  # TRUNCATEs read: warned, counted, kept for status
        # The snapshot's signal rows come through the binlog: the stream reads the signal table too.
        self._signal: str | None = None
        chunks: ChunkSource
        try:
            self._signal = signal_table(config)
            chunks = MysqlChunkReader(config, self._engine)
        except ConfigError as exc:  # no database to put it in (a URL without one, tables qualified)
            if config.snapshot == "initial":
                raise
            chunks = _NoSnapshots(exc)  # no signal is read, so no snapshot can start
        self._snapshots: SnapshotCoordinator[Any] = SnapshotCoordinator(config, self, chunks)

    # ------------------------------------------------------------------------------ the port

    @property
    def fingerprint(self) -> str:
        return self._fingerprint

    @property
    def prefetch_pages(self) -> bool:
        """Whether the tick reads and decodes the next pages while it sends these
        (poller.tick.prefetch). The source supports it (a read moves nothing; a page read ahead of a
        tick that stops is dropped and read again from the checkpoint; the stream closes with the
        tick's pin), but it is off: under ``dbfanout run`` (10-row commits, interleaved with reading
        in turn, 2026-11-29, a loaded 2-core box) it raised no throughput without linger (5,000
        offered: 984 and 1,538/s delivered against 1,534 and 1,952/s) and lowered it with linger
        1 s (2,500 offered: 695 and 1,333/s against 1,732 and 1,993/s) at up to twice the host
        CPU a change; cause not found (issue 41)."""
        return False

    def reads_on(self, page: Page) -> bool:
        """Whether the page after ``page`` may be read ahead: not while a snapshot runs (its chunk
        reads write watermarks; they keep the timing a tick reading in turn gives them)."""
        end = page.end
        return end is None or end.snapshot is None or not end.snapshot.active

    def fetch(self, after: Position | None, limit: int) -> Page:
        with self._lock, self._db_errors("fetch"):
            return self._fetch(after, limit)

    @contextmanager
    def pinned(self) -> Iterator[None]:
        """A tick's fetches read one stream; it is closed when the tick ends (no socket is left
        unread between ticks, where the server would time it out). The read-ahead thread pins too,
        inside the tick's pin: its end leaves the stream open for the tick's next drain (linger)."""
        with self._lock:
            self._pins += 1
        try:
            yield
        finally:
            with self._lock:
                self._pins -= 1
                if not self._pins:
                    self._close_reader()

    def acknowledge(self, checkpoint: Checkpoint) -> None:
        """Nothing to do: the server keeps its binlog for its retention time, not for a reader."""

    def close(self) -> None:
        with self._lock:
            self._close_reader()
        self._snapshots.close()

    # ------------------------------------------------------------------------------ operator surface

    def binlog_status(self, after: Position | None) -> dict[str, Any]:
        """Where the checkpoint stands in the binlog, and how much binlog is after it (``status``)."""
        with self._db_errors("status"), self._engine.connect() as conn:
            logs = [(str(r[0]), int(r[1])) for r in conn.execute(sa.text("SHOW BINARY LOGS"))]
            end = binlog_end(conn, self._config.name)
            conn.rollback()
        at = BinlogPosition.from_position(after) if after is not None else None
        behind = None
        if at is not None:
            sizes = {file_number(name): size for name, size in logs}
            behind = sum(size for n, size in sizes.items() if n > at.file_number)
            behind += max(sizes.get(at.file_number, 0) - at.txn_pos, 0)
        mib = 1024 * 1024
        return {
            "checkpoint_at": str(at) if at is not None else None,
            "binlog_end": f"{end[0]}:{end[1]}",
            "oldest_binlog": logs[0][0] if logs else None,
            "lag_bytes": behind,
            "lag": f"{behind / mib:.1f} MiB of binlog" if behind is not None else "-",
        }

    # ------------------------------------------------------------------------------ reading

    def _fetch(self, after: Position | None, limit: int) -> Page:
        """The coordinator's page (the stream, a snapshot's chunks beside it) from the checkpoint on.

        The first start (no checkpoint) takes the binlog's end now as its start: with ``snapshot =
        "initial"`` the snapshot begins there at once (its state rides on the positions returned),
        else the page only moves the checkpoint there.
        """
        first: Position | None = None
        if after is None:
            here = self._current()
            log.info("poller %s: no checkpoint yet: reading the binlog from %s", self._config.name, here)
            state = self._snapshots.state_at(None)
            first = self.position(here, state)
            if state is None or not state.active:
                return Page([], advance=first)
            after = first  # the initial snapshot begins in this fetch, from the binlog's end now
        with self._engine.connect() as conn:
            fetched = self._snapshots.fetch(conn, after, limit)
            conn.rollback()
        page, reader = fetched.page, self._reader
        if first is not None and not len(page) and page.advance is None:
            return Page([], advance=first)  # the checkpoint must take the start and its snapshot state
        if not len(page) and page.advance is None and fetched.last is None and reader is not None:
            start = BinlogPosition.from_position(after)
            if self._far(start, reader.position):  # other tables' traffic: move past it (see ADVANCE_BYTES)
                page = Page([], advance=self.position(reader.position, after.snapshot))
                if reader.drained:
                    self._stream_at = reader.position  # nothing of ours between: the stream reads on from it
        if reader is not None:  # a stream read in this fetch (an idle one closed it): where it ended
            end = page.end or after
            self._idle = (BinlogPosition.from_position(end), reader.end) if reader.drained else None
        self._truncates.attach(page)  # the checkpoints from this page on record the TRUNCATEs read
        return page

    # ------------------------------------------------------------------------------ the coordinator's log reader

    @property
    def signal_table(self) -> str:
        return self._signal or ""  # none: no change's table is ""

    def qualify(self, table: str) -> str:
        return self._qualify(table)

    def key_of(self, position: Position | None) -> BinlogPosition | None:
        return BinlogPosition.from_position(position) if position is not None else None

    def changes(self, conn: sa.Connection, after: BinlogPosition | None, want: int) -> LogRead[Any]:
        """Up to ``want`` changes after ``after``: from the open stream when it stands there (read
        on past the end it was opened for when the binlog grew), else from a new one; none, and no
        stream opened, when the binlog has not moved since a read reached its end there."""
        assert after is not None  # the first start never reaches the coordinator (see _fetch)
        reader = self._reader
        if reader is not None and self._stream_at == after:
            if reader.drained:
                now = binlog_end(conn, self._config.name)
                if now == reader.end:
                    return LogRead([], True)
                reader.extend(now)
        else:
            self._close_reader()
            idle = self._idle
            if idle is not None and idle[0] == after and binlog_end(conn, self._config.name) == idle[1]:
                return LogRead([], True)
            reader = self._open(after)
        try:
            read = reader.read(want)
        except BaseException:
            self._close_reader()
            raise
        if reader.truncated:
            self._truncates.note(reader.truncated)
        if read:
            self._stream_at = read[-1].position
        # Other pollers' signal rows pass too: signal() finds them not ours (one list pass saved per page).
        return LogRead(read, reader.drained)

    def reread(self) -> None:
        """Nothing buffered past the stream: a drained stream checks the binlog's end on its next read."""

    def signal(self, change: Any) -> Signal | None:
        return signal_of(text_values(change.after), self._config.name)

    def committed_at(self, change: Any) -> dt.datetime:
        committed: dt.datetime = change.committed_at
        return committed

    def keys(self, conn: sa.Connection, change: Any) -> list[tuple[Any, ...]]:
        """The primary keys a change touches (an update that changes the key: both)."""
        pk = change.pk
        images = (change.after, change.before)
        return [tuple(image[p] for p in pk) for image in images if image and all(p in image for p in pk)]

    def row(self, conn: sa.Connection, change: Any, state: SnapshotState | None) -> SourceRow:
        return self._row(change, state)

    def position(self, key: BinlogPosition | None, state: SnapshotState | None) -> Position:
        assert key is not None  # a binlog poller always has a position (its first start takes the end)
        return _with_state(key.to_position(), state)

    def cursor(self, key: BinlogPosition | None) -> CursorValue:
        assert key is not None
        return key.event_cursor()

    def describe(self, key: BinlogPosition) -> str:
        return str(key)

    def _far(self, start: BinlogPosition, now: BinlogPosition) -> bool:
        """Whether an empty page should still move the checkpoint from ``start`` to ``now``."""
        if now.file_number != start.file_number:
            return True
        return now.txn_pos - start.txn_pos >= ADVANCE_BYTES

    def _open(self, start: BinlogPosition) -> Any:
        from poller.sources.mysql_binlog.reader import BinlogReader  # an optional package: see the module doc

        until = self._check_retained(start)
        _args, kwargs = self._engine.dialect.create_connect_args(self._engine.url)
        connection = {**kwargs, "connect_timeout": 10}
        connection.pop("client_flag", None)
        reader = BinlogReader(
            connection,
            self._config.server_id,
            self._tables | {self._signal} if self._signal else self._tables,
            start,
            until,
            by_gtid=bool(self._is_mariadb()),
            pk=self._config.pk,
        )
        self._reader, self._stream_at = reader, start
        self.streams_opened += 1
        return reader

    def _close_reader(self) -> None:
        reader, self._reader = self._reader, None
        if reader is not None:
            with suppress(Exception):  # a broken stream has nothing left to close cleanly
                reader.close()

    # ------------------------------------------------------------------------------ the server

    def _current(self) -> BinlogPosition:
        """The binlog's end now, with MariaDB's GTID state at that very position."""
        with self._engine.connect() as conn:
            file, pos = binlog_end(conn, self._config.name)
            state = None
            if self._is_mariadb(conn):
                state = conn.execute(sa.text("SELECT BINLOG_GTID_POS(:f, :p)"), {"f": file, "p": pos}).scalar()
            conn.rollback()
        return BinlogPosition.at(file, pos, gtid_state=state if state is not None else None)

    def _is_mariadb(self, conn: sa.Connection | None = None) -> bool:
        if self._mariadb is None:
            if conn is None:
                with self._engine.connect() as own:
                    return self._is_mariadb(own)
            version = str(conn.execute(sa.text("SELECT VERSION()")).scalar())
            self._mariadb = "mariadb" in version.lower()
        return self._mariadb

    def _check_retained(self, start: BinlogPosition) -> tuple[str, int]:
        """The binlog's end now (where the stream opened next reads to). A checkpoint whose
        binlog file the server no longer has is an error, never a skip."""
        with self._engine.connect() as conn:
            files = [str(r[0]) for r in conn.execute(sa.text("SHOW BINARY LOGS"))]
            end = binlog_end(conn, self._config.name)
            conn.rollback()
        if not files:
            raise SourceError(
                f"poller {self._config.name}: the server at {self._url} has no binary logs (log_bin off?)"
            )
        numbers = [file_number(f) for f in files]
        if start.file_number < min(numbers):
            raise SourceError(
                f"poller {self._config.name}: the checkpoint's binlog position {start} was purged "
                f"(the oldest binlog on {self._url} is {files[0]}): changes after it are lost to this poller",
                hint="raise the binlog retention (binlog_expire_logs_seconds) so it cannot happen again; then "
                "`dbfanout checkpoint reset` the poller (it resumes at the binlog's end) and reload the tables' "
                "rows with `dbfanout snapshot`; see docs/operations.md",
            )
        return end

    def _db_errors(self, op: str) -> AbstractContextManager[None]:
        return binlog_errors(f"poller {self._config.name}: {op} from the binlog at {self._url}", self._config)


def _with_state(position: Position, state: SnapshotState | None) -> Position:
    return Position(position.cursor, position.pk, state) if state is not None else position


class _NoSnapshots:
    """The chunk source of a poller whose signal table has no database to live in: never called
    (no signal row is read, and snapshot = "initial" refuses such a poller); says why if it is."""

    def __init__(self, error: ConfigError) -> None:
        self._error = error

    def _refuse(self, *args: Any, **kwargs: Any) -> Any:
        raise self._error

    pk = estimate = columns = check_where = check_published = read = read_ahead = _refuse

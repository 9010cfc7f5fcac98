"""What the snapshot coordinator asks of a change log and of a database's chunk SQL.

A log source (``pg_logical``, ``mysql_binlog``) implements :class:`LogReader` over its changes
(:class:`LogChange`) and hands the coordinator (:mod:`poller.snapshot.coordinator`) a
:class:`ChunkSource`; positions are opaque to the coordinator (see its module docstring).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import sqlalchemy as sa

from poller.ports import SourceRow
from poller.snapshot.chunks import Chunk
from shared.models import CursorValue, Position, SnapshotState

__all__ = ["C", "ChunkSource", "LogChange", "LogRead", "LogReader", "Signal"]

#: A signal row decoded: ``(kind, id, data)`` (see :func:`poller.snapshot.requests.signal_of`).
Signal = tuple[str, str, dict[str, Any]]


class LogChange(Protocol):
    """What the coordinator reads of a change of the log (anything else goes through the reader)."""

    @property
    def key(self) -> Any:
        """Its position key: opaque, totally ordered in log order (``<``), hashable."""

    @property
    def table(self) -> str:
        """The schema-qualified table it changed (the signal table's name for a signal row)."""


C = TypeVar("C", bound=LogChange)


@dataclass(slots=True)
class LogRead(Generic[C]):
    """Changes of the log after a position, in log order."""

    changes: Sequence[C]
    at_end: bool  # nothing follows them in the log as of this read (it was read to its end)


class LogReader(Protocol[C]):
    """What a log source gives the coordinator. Everything here reads the log or describes it;
    the snapshot's state lives in the coordinator."""

    @property
    def signal_table(self) -> str:
        """The signal table's name as the log's changes name it (``LogChange.table``)."""

    def qualify(self, table: str) -> str:
        """A configured table's name as the log's changes name it (``orders`` → ``public.orders``)."""

    def key_of(self, position: Position | None) -> Any:
        """A checkpoint's position key (None: before the whole log). Raises SourceError for a
        position another source kind wrote."""

    def changes(self, conn: sa.Connection, after: Any, want: int) -> LogRead[C]:
        """Up to ``want`` changes after key ``after`` (fewer when the log ends first; may be more
        reads of the log): the poller's tables' and the signal table's (other pollers' signal rows
        may come too: :meth:`signal` finds them not ours)."""

    def reread(self) -> None:
        """The log grew by a write of ours (a high watermark): the next :meth:`changes` must read
        the log again, not what it buffered."""

    def signal(self, change: C) -> Signal | None:
        """A signal-table change decoded (None: not a signal of this poller)."""

    def committed_at(self, change: C) -> dt.datetime:
        """When the change's transaction committed (UTC)."""

    def keys(self, conn: sa.Connection, change: C) -> list[tuple[Any, ...]]:
        """The primary keys a change touches (an update that changes the key: both)."""

    def row(self, conn: sa.Connection, change: C, state: SnapshotState | None) -> SourceRow:
        """The row (event) a change becomes, its position carrying ``state``."""

    def position(self, key: Any, state: SnapshotState | None) -> Position:
        """The checkpoint form of key ``key`` (None: before the whole log), carrying ``state``."""

    def cursor(self, key: Any) -> CursorValue:
        """The event ``cursor`` of a snapshot row emitted at key ``key`` (None: before the log)."""

    def describe(self, key: Any) -> str:
        """Key ``key`` as an operator reads it (logs; and a repeated request's id suffix)."""


class ChunkSource(Protocol):
    """A database's snapshot SQL (:class:`poller.snapshot.postgres.ChunkReader` for PostgreSQL,
    :class:`poller.snapshot.mysql.MysqlChunkReader` for MySQL/MariaDB: both are
    :class:`~poller.snapshot.chunks.BaseChunkReader`).

    ``read`` selects the next chunk of ``state`` and commits its high watermark (a signal row the
    log then carries); the chunk's window opens at ``start``, the key the walk stood at before the
    read, so the read must make sure every change its select could not see is after ``start`` in
    the log (PostgreSQL refuses a racy snapshot: None, retried with backoff; MySQL commits a
    barrier first). ``read_ahead`` is the same on a connection of its own (a thread). A chunk's
    tuples are the row's columns (``Chunk.names``), then the row's version as a string (``t[-2]``:
    part of a snapshot event's id), then a flag.
    """

    def pk(self, table: str) -> tuple[str, ...]: ...

    def estimate(self, tables: Sequence[str]) -> int | None: ...

    def columns(self, table: str) -> frozenset[str]: ...

    def check_where(self, tables: Sequence[str], where: str | None) -> None: ...

    def check_published(self) -> None: ...

    def read(
        self,
        conn: sa.Connection,
        state: SnapshotState,
        start: Any,
        chunk_id: str | None = None,
        limit: int | None = None,
    ) -> Chunk | None: ...

    def read_ahead(self, state: SnapshotState, start: Any, chunk_id: str, limit: int | None = None) -> Chunk | None: ...

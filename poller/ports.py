"""The poller's ports: the three things a tick talks to. Adapters live in their own modules.

Every adapter of a port keeps the same contract, fakes included (the in-memory state store
rejects a stale ETag exactly like the blob one), and contract tests run against all of them.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from shared.models import Batch, Checkpoint, CursorValue, Position, StateDoc

__all__ = [
    "SOURCE_NOTES",
    "EventFields",
    "KeysetColumns",
    "Page",
    "Sink",
    "Snapshot",
    "Source",
    "SourceRow",
    "StateStore",
]

#: The key of the source's notes in ``checkpoint.metadata`` (see :attr:`Page.notes`).
SOURCE_NOTES = "source"


@dataclass(frozen=True, slots=True)
class Snapshot:
    """A state document together with the ETag it was read or written with."""

    doc: StateDoc
    etag: str


class StateStore(Protocol):
    """One state blob per poller; every mutation is exactly one conditional write (STYLE R1)."""

    poller_name: str

    def load(self) -> Snapshot | None:
        """Read the state blob (None when it does not exist yet). Raises StateUnavailableError."""
        ...

    def try_acquire(self, owner_id: str, ttl: dt.timedelta, fingerprint: str) -> Snapshot | None:
        """Take the lease when free or lapsed (past the skew margin); bump the fencing token.

        Returns None when someone else holds it or won the race: a lost race is an outcome,
        not an error. A live lease that names ``owner_id`` is ours (an earlier write whose answer
        was lost): renewed, token kept. Creates the blob (If-None-Match: *) on first use.
        """
        ...

    def heartbeat(self, snap: Snapshot, ttl: dt.timedelta) -> Snapshot:
        """Extend our lease (If-Match). Raises LostLeaseError when the ETag moved."""
        ...

    def commit(self, snap: Snapshot, checkpoint: Checkpoint, ttl: dt.timedelta | None = None) -> Snapshot:
        """Write the checkpoint (If-Match), optionally extending the lease in the same write.

        Raises LostLeaseError (ETag moved: W4), CommitAmbiguousError (timeout: W5) or
        CommitError (other failure: W1).
        """
        ...

    def release(self, snap: Snapshot) -> Snapshot:
        """Give the lease up so it is immediately re-acquirable (If-Match). LostLeaseError if moved."""
        ...

    def replace(self, snap: Snapshot | None, doc: StateDoc) -> Snapshot:
        """Operator write (CLI reset/clone): CAS against ``snap`` (or create when None)."""
        ...


@dataclass(frozen=True, slots=True)
class EventFields:
    """A change-log row's event fields, when they are not the keyset's (pk columns, cursor column).

    An outbox row or a decoded WAL change knows which entity changed (``pk``), where it sits in
    the log (``cursor``: part of the event id, so it must identify the change), and the precise
    change (the envelope's optional ``change``); the row's ``values`` are the event's ``after``.
    """

    pk: Mapping[str, Any]
    cursor: CursorValue
    change: str | None = None
    before: Mapping[str, Any] | None = None
    table: str | None = None  # the table the row came from (schema-qualified when known)
    # What identifies the row version in the event id when the cursor does not (a snapshot row:
    # its xmin, so a re-read of the same version gets the same id); None: the cursor does.
    version: Any = None
    committed_at: dt.datetime | None = None  # when the source committed it, if it knows (telemetry)


@dataclass(frozen=True, slots=True)
class SourceRow:
    """One row as fetched: its keyset position, and its column values (the event's ``after``)."""

    position: Position
    values: dict[str, Any]
    deleted: bool = False
    event: EventFields | None = None  # set by change-log sources; None: pk and cursor from the keyset

    @property
    def cursor(self) -> CursorValue:
        return self.position.cursor


@dataclass(frozen=True, slots=True)
class KeysetColumns:
    """How a keyset source's fetched tuples become rows, so a sink can encode a page column-wise.

    ``make_row`` of the same page must agree with it: values are the result columns except
    ``raw_cursor``; the cursor column's value is ``convert(raw)[1]`` when ``convert`` is set.
    """

    keys: tuple[str, ...]  # the result's columns, in tuple order
    cursor: str
    pk: tuple[str, ...]
    raw_cursor: str | None = None  # a result column carrying the compared cursor (not a value)
    convert: Callable[[Any], tuple[Any, Any]] | None = None  # raw cursor -> (position, event value)
    soft_delete: str | None = None

    def row_builder(self) -> Callable[[Any], SourceRow]:
        """The builder of one :class:`SourceRow` from one fetched tuple."""
        keys, cursor, pk_names, raw_cursor = self.keys, self.cursor, self.pk, self.raw_cursor
        convert, soft = self.convert, self.soft_delete

        def make_row(tup: Any) -> SourceRow:
            values = dict(zip(keys, tup))  # noqa: B905 - keys come from this very result
            raw = values.pop(raw_cursor) if raw_cursor is not None else values[cursor]
            if convert is not None:
                raw, values[cursor] = convert(raw)
            deleted = False
            if soft is not None:
                flag = values[soft]
                deleted = flag is not None and flag is not False and flag != 0
            return SourceRow(Position(raw, {p: values[p] for p in pk_names}), values, deleted)

        return make_row


class Page:
    """One keyset page, in ``(cursor, pk)`` order. Empty means caught up.

    A source may hand over the fetched tuples with a row builder instead of built rows: the tick
    needs only the count and the last position, so rows (and the events made of them) are built
    once, on first access, by whoever reads them (the sink).

    ``advance``: a position past the last row that the checkpoint must reach even though no row
    carries it (a pg_logical snapshot's state moved: a request, a cancel, a chunk with no row
    left). The tick checkpoints :attr:`end`, and writes it even when the page has no row.

    ``more``: the page is short but the source is not caught up (a pg_logical poller hands the
    stream's rows over at once, ahead of a snapshot chunk's); the tick goes on as after a full page.

    ``notes``: how the page updates the source's notes, which every checkpoint carries on in
    ``checkpoint.metadata[SOURCE_NOTES]`` (a pg_logical poller's last TRUNCATE: ``dbfanout status``
    shows it); a pure function of the notes so far, so a page read again changes nothing twice.
    """

    __slots__ = (
        "_last_row",
        "_make_row",
        "_rows",
        "_tuples",
        "advance",
        "columns",
        "more",
        "notes",
        "skipped_null_cursors",
    )

    def __init__(
        self,
        rows: Sequence[SourceRow] | None = None,
        *,
        tuples: Sequence[Any] | None = None,
        make_row: Callable[[Any], SourceRow] | None = None,
        columns: KeysetColumns | None = None,
        skipped_null_cursors: int = 0,
        advance: Position | None = None,
        more: bool = False,
    ) -> None:
        if (rows is None) == (tuples is None) or (tuples is not None and make_row is None):
            raise ValueError("Page needs either rows, or tuples with make_row")
        self._rows = rows
        self._tuples = tuples
        self._make_row = make_row
        self._last_row: SourceRow | None = None
        # With tuples: how they map to rows, for a sink that encodes the page without building rows.
        self.columns = columns if tuples is not None else None
        self.skipped_null_cursors = skipped_null_cursors
        self.advance = advance
        self.more = more
        self.notes: Callable[[Mapping[str, Any]], Mapping[str, Any]] | None = None

    def caught_up(self, limit: int) -> bool:
        """Whether the source had no more than this page to give (a short page, not marked ``more``)."""
        return len(self) < limit and not self.more

    def __len__(self) -> int:
        return len(self._rows if self._rows is not None else self._tuples)  # type: ignore[arg-type]

    def __repr__(self) -> str:
        return f"Page(rows={len(self)}, skipped_null_cursors={self.skipped_null_cursors})"

    @property
    def rows(self) -> Sequence[SourceRow]:
        if self._rows is None:
            assert self._tuples is not None and self._make_row is not None
            self._rows = list(map(self._make_row, self._tuples))
        return self._rows

    @property
    def tuples(self) -> Sequence[Any] | None:
        """The fetched tuples when the page was handed over as tuples (see ``columns``)."""
        return self._tuples

    @property
    def first_row(self) -> SourceRow | None:
        return self._row_at(0) if len(self) else None

    @property
    def last_row(self) -> SourceRow | None:
        if self._last_row is None and len(self):
            self._last_row = self._row_at(-1)
        return self._last_row

    def _row_at(self, index: int) -> SourceRow:
        """One row, without building the others."""
        if self._rows is not None:
            return self._rows[index]
        assert self._tuples is not None and self._make_row is not None
        return self._make_row(self._tuples[index])

    @property
    def last(self) -> Position | None:
        row = self.last_row
        return row.position if row is not None else None

    @property
    def end(self) -> Position | None:
        """Where the next page starts and the checkpoint goes: ``advance`` if set, else the last row's."""
        return self.advance if self.advance is not None else self.last

    def mapped(self, convert: Callable[[SourceRow], SourceRow]) -> Page:
        """This page with every row passed through ``convert`` (still built lazily, on access)."""
        if self._rows is not None:
            rows = [convert(r) for r in self._rows]
            return Page(rows, skipped_null_cursors=self.skipped_null_cursors, advance=self.advance, more=self.more)
        make = self._make_row
        assert make is not None
        return Page(
            tuples=self._tuples, make_row=lambda t: convert(make(t)), skipped_null_cursors=self.skipped_null_cursors
        )


class Source(Protocol):
    """A database table or query read in keyset order."""

    @property
    def fingerprint(self) -> str:
        """Hash of the source definition (URL without password, table/query, cursor, pk, filter)."""
        ...

    def fetch(self, after: Position | None, limit: int) -> Page:
        """Rows strictly after ``after`` in ``(cursor, pk)`` order, at most ``limit``.

        Only rows older than the settle window (on the database clock) are returned.
        Raises FetchError (transient) or SourceError/CursorError (fix the config or data).
        """
        ...

    def pinned(self) -> AbstractContextManager[None]:
        """Within it, this thread's fetches may reuse one connection (a tick's pages)."""
        ...

    def acknowledge(self, checkpoint: Checkpoint) -> None:
        """``checkpoint`` landed (a committed state write): housekeeping it allows may run now.

        Called once at the end of a tick that held the lease (with the checkpoint as it stands,
        its position None before the first one), never before the write landed. The outbox
        prunes rows it covers; a slot-based source would advance its slot.
        Best effort: an error is logged by the tick and does not fail it.
        """
        ...

    def close(self) -> None: ...


@runtime_checkable
class CountsPending(Protocol):
    """A source that can count the rows a fetch would still return (keyset and outbox reads)."""

    def pending_rows(self, after: Position | None, limit: int) -> int:
        """Rows a fetch after ``after`` would return, counted up to ``limit`` (one bounded count)."""
        ...


class Sink(Protocol):
    """Where batches go. ``send`` returns only when every message of the batch was accepted."""

    def send(self, batch: Batch) -> None:
        """Raises EnqueueError when any message was not accepted (the checkpoint must not move)."""
        ...

    def close(self) -> None: ...

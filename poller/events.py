"""Turning fetched rows into events and batches (pure; no I/O)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import overload

from poller.ports import Page, SourceRow
from shared.config import PollerConfig
from shared.ids import EventIds, batch_id_for_range, event_id_for
from shared.models import Batch, RowChange

__all__ = ["LazyEvents", "page_batch", "to_batch", "to_event"]


def to_event(poller: PollerConfig, fingerprint: str, row: SourceRow, ids: EventIds | None = None) -> RowChange:
    """One row → one event. The id is a pure function of (poller, fingerprint, pk, cursor)."""
    fields = row.event
    if fields is None:  # keyset polling: the pk columns and the cursor column's typed value
        cursor = row.values.get(poller.cursor, row.position.cursor)
        pk = row.position.pk
    else:
        cursor, pk = fields.cursor, fields.pk
    event_id = ids(pk, cursor) if ids is not None else event_id_for(poller.name, fingerprint, pk, cursor)
    return RowChange(
        event_id=event_id,
        op="delete" if row.deleted else "upsert",
        pk=pk,
        cursor=cursor,
        # The source builds a fresh dict per row; nobody mutates it. A change-log delete brings
        # no values (its old key or row is ``before``): its ``after`` is null.
        after=row.values if row.values or not row.deleted else None,
        poller=poller.name,
        before=fields.before if fields is not None else None,
        change=fields.change if fields is not None else None,
    )


class LazyEvents(Sequence[RowChange]):
    """A batch's events, built on first access (all at once) and then kept.

    The tick needs only the count; a sink that forwards or encodes the events builds them once.
    Compares equal to any sequence of the same events (a decoded batch holds a tuple).
    """

    __slots__ = ("_build", "_count", "_events")

    def __init__(self, count: int, build: Callable[[], tuple[RowChange, ...]]) -> None:
        self._count = count
        self._build: Callable[[], tuple[RowChange, ...]] | None = build
        self._events: tuple[RowChange, ...] | None = None

    def _all(self) -> tuple[RowChange, ...]:
        if self._events is None:
            assert self._build is not None
            self._events, self._build = self._build(), None
        return self._events

    def __len__(self) -> int:
        return self._count

    @overload
    def __getitem__(self, index: int) -> RowChange: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[RowChange]: ...
    def __getitem__(self, index: int | slice) -> RowChange | Sequence[RowChange]:
        return self._all()[index]

    def __iter__(self) -> Iterator[RowChange]:
        return iter(self._all())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Sequence) and not isinstance(other, str | bytes):
            return self._all() == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._all())

    def __repr__(self) -> str:
        built = "built" if self._events is not None else "not built yet"
        return f"LazyEvents({self._count} events, {built})"


def _range_id(poller: PollerConfig, fingerprint: str, page: Page) -> str:
    first, last = page.first_row, page.last_row
    assert first is not None and last is not None
    return batch_id_for_range(poller.name, fingerprint, first.position, last.position, len(page))


def to_batch(poller: PollerConfig, fingerprint: str, rows: Sequence[SourceRow]) -> Batch:
    """Built rows → a batch with its events built now (validation, tests)."""
    ids = EventIds(poller.name, fingerprint)
    return Batch(
        poller=poller.name,
        batch_id=_range_id(poller, fingerprint, Page(rows)),
        source_fingerprint=fingerprint,
        events=tuple(to_event(poller, fingerprint, row, ids) for row in rows),
    )


def page_batch(poller: PollerConfig, fingerprint: str, page: Page) -> Batch:
    """A fetched page → its batch; events are built when the sink first reads them.

    Re-fetching the same page (after a failed commit, a crash or a lost lease) yields the same
    batch id and the same event ids.
    """

    def build() -> tuple[RowChange, ...]:
        ids = EventIds(poller.name, fingerprint)
        return tuple(to_event(poller, fingerprint, row, ids) for row in page.rows)

    return Batch(
        poller=poller.name,
        batch_id=_range_id(poller, fingerprint, page),
        source_fingerprint=fingerprint,
        events=LazyEvents(len(page), build),
    )

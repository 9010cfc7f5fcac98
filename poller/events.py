"""Turning fetched rows into events and batches (pure; no I/O)."""

from __future__ import annotations

from collections.abc import Sequence

from poller.ports import SourceRow
from shared.config import PollerConfig
from shared.ids import EventIds, batch_id_for, event_id_for
from shared.models import Batch, RowChange

__all__ = ["to_batch", "to_event"]


def to_event(poller: PollerConfig, fingerprint: str, row: SourceRow, ids: EventIds | None = None) -> RowChange:
    """One row → one event. The id is a pure function of (poller, fingerprint, pk, cursor)."""
    cursor = row.values.get(poller.cursor, row.position.cursor)
    pk = row.position.pk
    event_id = ids(pk, cursor) if ids is not None else event_id_for(poller.name, fingerprint, pk, cursor)
    return RowChange(
        event_id=event_id,
        op="delete" if row.deleted else "upsert",
        pk=pk,
        cursor=cursor,
        after=row.values,  # the source builds a fresh dict per row; nobody mutates it
        poller=poller.name,
        before=None,
    )


def to_batch(poller: PollerConfig, fingerprint: str, rows: Sequence[SourceRow]) -> Batch:
    """A page → a batch; re-fetching the same page yields the same batch id and event ids."""
    ids = EventIds(poller.name, fingerprint)
    events = tuple(to_event(poller, fingerprint, row, ids) for row in rows)
    return Batch(
        poller=poller.name,
        batch_id=batch_id_for(poller.name, fingerprint, [e.event_id for e in events]),
        source_fingerprint=fingerprint,
        events=events,
    )

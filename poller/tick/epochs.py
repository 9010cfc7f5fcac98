"""The order epoch: what keeps "apply only if newer" right when a poller's cursors go backwards.

A handler that applies a change only if it is newer (:class:`worker.ordering.LatestVersions`)
compares cursors. Within one history they grow, but a history can change under the poller: an HA
failover to a MariaDB/MySQL server whose GTIDs restart or sort lower, a promotion to a PostgreSQL
standby that was behind, a replaced slot. The next change then carries a *lower* cursor than the
last one sent, and a cursor-only guard skips it, and every later change of its key, for good.

So each batch carries an ``epoch`` (:attr:`shared.models.Batch.epoch`, every event's
:attr:`~shared.models.RowChange.epoch`): a change whose cursor is less than the last one sent (or
not comparable with it) starts the next epoch. Equal cursors (keyset ties) do not. Ordered by
``(epoch, cursor)``, a poller's changes compare the way it sent them.

The epoch and the last cursor sent travel with the checkpoint (``checkpoint.metadata["order"]``),
written by the same CAS as the position they are valid at, so a page read again after a failed
commit gets the same epochs (computed from the committed checkpoint only), and a new owner goes on
where the last left off. A page whose events span two epochs goes as two batches.

Cost: one comparison per event of a log source's page (its rows are built anyway). A keyset page
handed over as tuples (:attr:`poller.ports.Page.tuples`) is ordered by its own ``ORDER BY`` from
after the checkpoint, so only its first row is compared: its encoding fast path builds no row.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from functools import partial
from itertools import pairwise
from typing import Any

from poller.ports import Page, SourceRow
from poller.tick.events import to_batch
from shared.codec import decode_value, encode_value
from shared.config import PollerConfig
from shared.logs import get_logger, ids
from shared.models import Batch, CursorValue

__all__ = ["ORDER", "Order", "epoch_starts", "page_batches"]

log = get_logger("poller.tick")

#: The key of the order epoch in ``checkpoint.metadata``: ``{"epoch": n, "last": <cursor>}``.
ORDER = "order"


@dataclass(frozen=True, slots=True)
class Order:
    """The epoch of the last event sent, and its cursor (None: nothing sent yet)."""

    epoch: int = 0
    last: CursorValue | None = None

    @classmethod
    def of(cls, metadata: Mapping[str, Any]) -> Order:
        """The order a checkpoint's metadata holds (none: epoch 0, nothing sent)."""
        raw = metadata.get(ORDER)
        if not isinstance(raw, dict):
            return cls()
        epoch = raw.get("epoch")
        return cls(epoch if type(epoch) is int and epoch >= 0 else 0, _decode_cursor(raw.get("last")))

    def note(self) -> dict[str, Any] | None:
        """What ``checkpoint.metadata[ORDER]`` holds (None: nothing to keep yet)."""
        if self.last is None and not self.epoch:
            return None
        return {"epoch": self.epoch, "last": None if self.last is None else _encode_cursor(self.last)}


def _encode_cursor(cursor: CursorValue) -> dict[str, Any]:
    parts = cursor if isinstance(cursor, tuple) else (cursor,)
    return {"v": [list(encode_value(p)) for p in parts], "tuple": isinstance(cursor, tuple)}


def _decode_cursor(raw: Any) -> CursorValue | None:
    """The last cursor sent; None when absent or unreadable (then the next event cannot regress)."""
    if not isinstance(raw, dict) or not isinstance(raw.get("v"), list):
        return None
    try:
        parts = tuple(decode_value(v, t) for v, t in raw["v"])
    except (TypeError, ValueError):
        return None
    if raw.get("tuple") is True:
        return parts
    return parts[0] if len(parts) == 1 else None


def _cursor(poller: PollerConfig, row: SourceRow) -> CursorValue:
    """The event cursor of ``row`` (what :func:`poller.tick.events.to_event` puts in the event)."""
    if row.event is not None:
        return row.event.cursor
    cursor: CursorValue = row.values.get(poller.cursor, row.position.cursor)
    return cursor


def epoch_starts(cursors: Iterable[CursorValue], last: CursorValue | None) -> tuple[list[int], CursorValue | None]:
    """Where a new epoch starts among ``cursors`` (sent after ``last``), and the last cursor: one
    comparison per cursor."""
    starts: list[int] = []
    for index, cursor in enumerate(cursors):
        if last is not None:
            try:
                if cursor < last:  # type: ignore[operator]
                    starts.append(index)
            except TypeError:  # another cursor shape (a GTID source after a file-and-offset one, ...)
                starts.append(index)
        last = cursor
    return starts, last


def page_batches(
    poller: PollerConfig, fingerprint: str, page: Page, batch: Batch, order: Order
) -> tuple[list[Batch], Order]:
    """``batch`` (the page's) with its epoch, or one batch per epoch its events span; the order after it."""
    if page.tuples is not None:  # a keyset page in its own ORDER BY: its first and last row only
        first, last = page.first_row, page.last_row
        assert first is not None and last is not None
        starts, _ = epoch_starts((_cursor(poller, first),), order.last)
        epoch = order.epoch + len(starts)
        return [replace(batch, epoch=epoch)], Order(epoch, _cursor(poller, last))
    rows = page.rows
    starts, cursor = epoch_starts(map(partial(_cursor, poller), rows), order.last)
    after = Order(order.epoch + len(starts), cursor)
    if starts:
        log.warning(
            "cursors went backwards: order epoch %d starts (a failover, a replaced slot or position)",
            after.epoch,
            extra=ids(poller=poller.name, batch_id=batch.batch_id),
        )
    if not starts or starts == [0]:
        return [replace(batch, epoch=after.epoch)], after
    # A page spanning epochs goes as one batch per epoch (rare: a regression inside the page).
    bounds = sorted({0, *starts, len(rows)})
    first_epoch = after.epoch - len(bounds) + 2
    batches = []
    for i, (a, b) in enumerate(pairwise(bounds)):
        part = to_batch(poller, fingerprint, rows[a:b])
        batches.append(replace(batch, batch_id=part.batch_id, events=part.events, epoch=first_epoch + i))
    return batches, after

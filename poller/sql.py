"""SQL helpers every source and the snapshot share, whatever the database.

Below :mod:`poller.sources` and :mod:`poller.snapshot` (both import it, it imports neither): a
keyset page and a snapshot chunk are both read with :func:`fetch_tuples`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import sqlalchemy as sa

__all__ = ["fetch_tuples"]


def fetch_tuples(
    result: sa.CursorResult[Any], processors: Sequence[Callable[[Any], Any] | None] | None = None
) -> Sequence[Any]:
    """Every row of ``result`` as a plain tuple, with the values SQLAlchemy would give.

    SQLAlchemy's ``Row`` objects cost about 1 µs a row to build (more than the rest of a page's
    fetch). So the driver's own ``fetchall`` is read and the result's type processors (e.g. SQLite
    NUMERIC → Decimal) are applied column by column, which gives the same values
    (tests/poller/test_sql.py). A result whose internals are not the expected ones is
    read with ``all()``. ``processors``: one per column, instead of the result's own (a ``SELECT *``
    has none: :class:`~poller.sources.keyset.table_shape.ResultShape` gives the reflected types' ones).
    """
    if processors is None:
        processors = getattr(getattr(result, "_metadata", None), "_processors", None)
    cursor = getattr(result, "cursor", None)
    if not isinstance(processors, list | tuple) or cursor is None:
        return result.all()
    try:
        rows: list[Any] = cursor.fetchall()
    finally:
        result.close()
    active = [(i, p) for i, p in enumerate(processors) if p is not None]
    if not active or not rows:
        return rows
    columns = list(zip(*rows, strict=True))
    for i, processor in active:
        columns[i] = tuple(map(processor, columns[i]))
    return list(zip(*columns, strict=True))

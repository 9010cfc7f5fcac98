"""A keyset page read: its SELECT run with the position's binds, its result checked against the
table's shape, and its rows handed over as tuples with the builder of a row (built lazily).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import sqlalchemy as sa

from poller.ports import KeysetColumns, SourceRow
from poller.sources.keyset.plan import CursorKind
from poller.sources.keyset.resolve import RAW_CURSOR, Resolved
from poller.sources.keyset.statements import Plan
from poller.sources.keyset.table_shape import ResultShape, description_signature, value_family
from poller.sql import fetch_tuples
from shared.config import PollerConfig
from shared.errors import CursorError
from shared.models import Position

__all__ = ["ShapeChanged", "bind", "read_page"]


class ShapeChanged(Exception):
    """A page's result is not in the shape its plan was made for (internal: the fetch re-plans)."""

    def __init__(self, value: Any = None, *, by_value: bool = False) -> None:
        super().__init__()
        self.value, self.by_value = value, by_value


def bind(config: PollerConfig, kind: CursorKind, after: Position) -> dict[str, Any]:
    """The seek predicate's parameters for a page after ``after``."""
    missing = [p for p in config.pk if p not in after.pk]
    if missing:
        raise CursorError(
            f"the checkpoint's tiebreaker has {sorted(after.pk)} but pk is {list(config.pk)}",
            hint="the pk setting changed under a checkpoint: reset the checkpoint or restore the old pk",
        )
    params = {"k0": kind.rebind(after.cursor)}
    params.update({f"k{i}": after.pk[p] for i, p in enumerate(config.pk, start=1)})
    return params


def read_page(
    conn: sa.Connection,
    config: PollerConfig,
    r: Resolved,
    plan: Plan,
    after: Position | None,
    limit: int,
    warn_once: Callable[..., None],
) -> tuple[Sequence[Any], Callable[[Any], SourceRow], KeysetColumns | None]:
    """Run the page's SELECT; return its tuples, the builder of one :class:`SourceRow` and their columns.

    Rows are built lazily (see :class:`~poller.ports.Page`): catching up costs one query and
    one ``fetchall`` per page, plus the last row's position. Raises :class:`ShapeChanged` when the
    table's shape is not the plan's.
    """
    cfg = config
    if after is None:
        result = conn.execute(plan.first, {"dbf_limit": limit})
    else:
        result = conn.execute(plan.after, {"dbf_limit": limit, **bind(config, plan.kind, after)})
    keys = list(result.keys())
    processors = _result_shape(conn, result, r, plan).processors if r.shape is not None else None
    tuples = fetch_tuples(result, processors)  # one fetchall: per-row fetchone costs as much as the query
    raw_extra = r.raw_extra
    if tuples and r.shape is not None:  # SQLite describes no types: a retyped cursor shows in its values
        raw = tuples[-1][keys.index(RAW_CURSOR if raw_extra else cfg.cursor)]
        if raw is not None and value_family(raw) != plan.family:
            raise ShapeChanged(raw, by_value=True)
    # The event carries the typed value; the position keeps what the database compares.
    convert = plan.kind.converter(cfg.cursor) if plan.kind.kind in ("naive", "text_datetime", "text_date") else None
    columns = KeysetColumns(
        tuple(keys), cfg.cursor, cfg.pk, RAW_CURSOR if raw_extra else None, convert, cfg.soft_delete_column
    )
    if plan.kind.kind == "text_datetime" and tuples:
        at = keys.index(RAW_CURSOR if raw_extra else cfg.cursor)
        _check_text_format(config, (tuples[0][at], tuples[len(tuples) // 2][at], tuples[-1][at]), plan.kind.sep,
                           warn_once)  # fmt: skip
    return tuples, columns.row_builder(), columns


def _result_shape(conn: sa.Connection, result: sa.CursorResult[Any], r: Resolved, plan: Plan) -> ResultShape:
    """The processors of a table page's result; ShapeChanged when its columns are not the plan's."""
    assert r.shape is not None
    description = result.cursor.description
    if plan.result is None:  # the plan's first read: the result must have the reflected columns
        plan.result = ResultShape.accept(
            description,
            r.shape.types(),
            conn.dialect,
            extra=RAW_CURSOR if r.raw_extra else None,
            unprocessed=plan.unprocessed,
        )
    if plan.result is None or description_signature(description) != plan.result.signature:
        result.close()
        raise ShapeChanged
    return plan.result


def _check_text_format(config: PollerConfig, raws: Iterable[Any], sep: str, warn_once: Callable[..., None]) -> None:
    """Sampled (first, middle, last of each page): a mixed format shows up within a few pages."""
    for raw in raws:
        if isinstance(raw, str) and len(raw) > 10 and raw[10] != sep:
            warn_once("format", "cursor %r mixes text formats (%r does not use %r as the date/time separator); "
                      "SQLite orders the text, so keep one format", config.cursor, raw, sep)  # fmt: skip
            return

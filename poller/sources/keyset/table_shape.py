"""A keyset table's shape: its columns as reflected, and how a page's result is checked against them.

A table-mode page selects ``*`` (:mod:`poller.sources.keyset.source`), so every fetch returns the table's
columns *of that moment*. The driver's description of the result (names and type codes) is
compared with the shape the page's plan was made for; a difference, or a statement that fails
because a column it names is gone, makes the source reflect the table again and re-plan in the
same fetch. Nothing is queried for this while the table keeps its shape: an idle fetch stays one
SELECT.

The cursor and key columns are what a checkpoint holds. A migration that renames, drops or
changes the kind of one of them is an operator decision (:class:`~shared.errors.SchemaChangeError`,
naming the column and :data:`RUNBOOK`); every other column just follows the table.

SQLite reports no type in a result's description: a type change there (a table rebuild) is seen
through the cursor's values (:func:`value_family`) and otherwise from the next re-reflection.
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import sqlalchemy as sa

from poller.sources.keyset.values import result_processor  # values as every source kind gives them
from shared.errors import SchemaChangeError

__all__ = [
    "RUNBOOK",
    "ResultShape",
    "TableShape",
    "description_signature",
    "key_change",
    "type_family",
    "value_family",
]

#: Where docs/operations.md says what to do when a migration changes a cursor or key column.
RUNBOOK = "docs/operations.md#schema-changes-migrations"

Processor = Callable[[Any], Any] | None
Signature = tuple[tuple[str, Any], ...]


@dataclass(frozen=True, slots=True)
class TableShape:
    """A table's columns as reflected, in table order."""

    columns: tuple[tuple[str, sa.types.TypeEngine[Any]], ...]

    @classmethod
    def of(cls, table: sa.Table) -> TableShape:
        return cls(tuple((c.name, c.type) for c in table.columns))

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self.columns]

    def types(self) -> dict[str, sa.types.TypeEngine[Any]]:
        return dict(self.columns)

    def same_as(self, other: TableShape) -> bool:
        return [(n, repr(t)) for n, t in self.columns] == [(n, repr(t)) for n, t in other.columns]

    def changes_since(self, before: TableShape) -> str:
        """What a migration changed, for the log: ``added a; dropped b; retyped c (INTEGER -> BIGINT)``."""
        old, new = before.types(), self.types()
        added = [n for n in new if n not in old]
        dropped = [n for n in old if n not in new]
        retyped = [f"{n} ({old[n]!r} -> {new[n]!r})" for n in new if n in old and repr(old[n]) != repr(new[n])]
        parts = [f"{what} {', '.join(names)}" for what, names in (("added", added), ("dropped", dropped),
                                                                   ("retyped", retyped)) if names]  # fmt: skip
        return "; ".join(parts) or "no column changed"


def type_family(type_: sa.types.TypeEngine[Any]) -> str:
    """The family a reflected type's values belong to: a key column may change type within one
    (int -> bigint, varchar -> text) and keep comparing as its checkpoint was written."""
    try:
        python = type_.python_type
    except NotImplementedError:  # NullType, dialect types without a Python equivalent
        return type(type_).__name__
    return _family(python)


def value_family(value: Any) -> str:
    """The family of one fetched value (see :func:`type_family`)."""
    return _family(type(value))


def _family(python: type) -> str:
    if issubclass(python, bool):
        return "boolean"
    if issubclass(python, int | float | Decimal):
        return "number"
    if issubclass(python, dt.datetime):
        return "datetime"
    if issubclass(python, dt.date):
        return "date"
    if issubclass(python, str):
        return "text"
    if issubclass(python, bytes | bytearray | memoryview):
        return "bytes"
    if issubclass(python, uuid.UUID):
        return "uuid"
    return python.__name__


def description_signature(description: Sequence[Sequence[Any]]) -> Signature:
    """A result's column names and DBAPI type codes (None on SQLite), as the driver describes them."""
    return tuple((d[0], d[1]) for d in description)


@dataclass(frozen=True, slots=True)
class ResultShape:
    """A page result's description as first seen for a plan, and the type processors it takes."""

    signature: Signature
    processors: tuple[Processor, ...]

    @classmethod
    def accept(
        cls,
        description: Sequence[Sequence[Any]],
        types: Mapping[str, sa.types.TypeEngine[Any]],
        dialect: sa.Dialect,
        *,
        extra: str | None,
        unprocessed: str | None,
    ) -> ResultShape | None:
        """The shape when ``description`` has exactly the reflected columns (plus ``extra``), else None.

        Each column gets the result processor SQLAlchemy itself would apply to that type and
        DBAPI type code, or the one :mod:`poller.sources.keyset.values` chooses (``unprocessed``:
        a column whose raw value is wanted, e.g. SQLite's text timestamps, converted elsewhere).
        """
        names = [d[0] for d in description]
        if names != [*types, *([extra] if extra else [])]:
            return None
        processors = tuple(
            None if name in (extra, unprocessed) else result_processor(types[name], dialect, code)
            for name, code in ((d[0], d[1]) for d in description)
        )
        return cls(description_signature(description), processors)


def key_change(poller: str, table: str, role: str, column: str, change: str) -> SchemaChangeError:
    """The error for a migration that changed a column the checkpoint depends on."""
    return SchemaChangeError(
        f"poller {poller}: a migration {change} the {role} column {column!r} of table {table!r}; the checkpoint "
        f"is held and nothing is delivered until an operator decides what the stored position means now "
        f"(runbook: {RUNBOOK})"
    )

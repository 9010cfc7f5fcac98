"""Operator-typed cursor and pk values (``--to-cursor 2026-04-07T01:00:00Z --pk id=42``).

A literal is read as the type the poller actually stores: the type of a *template* value (the
source's first position, else the current checkpoint). So ``42`` is an int for an integer
cursor and the string ``"42"`` for a text one, and a timestamp without an offset is refused for
a tz-aware cursor instead of being silently taken as local time.
"""

from __future__ import annotations

import datetime as dt
import re
import uuid
from collections.abc import Callable, Mapping, Sequence
from decimal import Decimal, InvalidOperation
from typing import Any

from shared.models import CursorValue, Lsn, Position

__all__ = ["LiteralError", "parse_literal", "parse_position"]

_ISO_DATETIME = re.compile(r"^\d{4}-\d{2}-\d{2}[ T]\d{2}:\d{2}")


class LiteralError(ValueError):
    """A value the operator typed does not fit the column's type (exit 2)."""


def _datetime(text: str, template: dt.datetime, what: str) -> dt.datetime:
    try:
        value = dt.datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        raise LiteralError(f"{what}: {text!r} is not an ISO timestamp (e.g. 2026-04-07T01:23:45.123456Z)") from None
    if template.tzinfo is not None and value.tzinfo is None:
        raise LiteralError(f"{what}: {text!r} has no UTC offset, but the cursor is tz-aware; add Z or +hh:mm")
    if template.tzinfo is None and value.tzinfo is not None:
        raise LiteralError(
            f"{what}: {text!r} has an offset, but the checkpoint stores the column's naive value; "
            "give the value as stored (in cursor_timezone), without an offset"
        )
    return value


def _text(text: str, template: str, what: str) -> str:
    # A SQLite text timestamp is compared as text: the literal must be written the same way.
    if _ISO_DATETIME.match(template):
        if not _ISO_DATETIME.match(text):
            raise LiteralError(f"{what}: {text!r} is not a timestamp like the stored ones ({template!r})")
        if len(text) > 10 and text[10] != template[10]:
            raise LiteralError(
                f"{what}: {text!r} separates date and time with {text[10]!r} but the column uses "
                f"{template[10]!r}; the database compares the text, so write it as stored"
            )
    return text


def parse_literal(text: str, template: Any, what: str) -> Any:
    """``text`` as the type of ``template``. Raises LiteralError saying what was expected."""
    if isinstance(template, bool):
        if text.lower() not in ("true", "false", "1", "0"):
            raise LiteralError(f"{what}: {text!r} is not a boolean")
        return text.lower() in ("true", "1")
    try:
        for kind, parse in _SIMPLE:
            if isinstance(template, kind):
                return parse(text)
        if isinstance(template, dt.datetime):
            return _datetime(text, template, what)
        if isinstance(template, str):
            return _text(text, template, what)
        if isinstance(template, dt.date):
            return dt.date.fromisoformat(text)
    except (ValueError, InvalidOperation) as exc:
        if isinstance(exc, LiteralError):
            raise
        raise LiteralError(f"{what}: {text!r} is not a valid {type(template).__name__}") from None
    raise LiteralError(f"{what}: values of type {type(template).__name__} cannot be typed in; use --from-file")


_SIMPLE: tuple[tuple[type, Callable[[str], Any]], ...] = (
    (Lsn, Lsn.parse),  # before int: an LSN is written as PostgreSQL writes it (0/1DE8350)
    (int, int),
    (Decimal, Decimal),
    (float, float),
    (uuid.UUID, uuid.UUID),
    (bytes, lambda t: bytes.fromhex(t.removeprefix("0x"))),
)


def parse_position(cursor_text: str, pk_args: Sequence[str], template: Position, pk_columns: Sequence[str]) -> Position:
    """``--to-cursor`` and ``--pk k=v`` (one per pk column) → a Position typed like ``template``.

    The position is exclusive: the poller re-delivers rows strictly after ``(cursor, pk)``.
    """
    if isinstance(template.cursor, tuple):
        raise LiteralError("--to-cursor: a composite cursor cannot be typed in; use --from-file")
    cursor: CursorValue = parse_literal(cursor_text, template.cursor, "--to-cursor")
    given: dict[str, str] = {}
    for arg in pk_args:
        name, sep, value = arg.partition("=")
        if not sep or not name:
            raise LiteralError(f"--pk: {arg!r} is not NAME=VALUE")
        given[name.strip()] = value
    missing = [c for c in pk_columns if c not in given]
    unknown = [c for c in given if c not in pk_columns]
    if missing or unknown:
        raise LiteralError(
            f"--pk: give every pk column once ({', '.join(f'{c}=...' for c in pk_columns)}); "
            f"missing {missing or 'none'}, unknown {unknown or 'none'}"
        )
    pk: Mapping[str, Any] = {c: parse_literal(given[c], template.pk.get(c, ""), f"--pk {c}") for c in pk_columns}
    return Position(cursor=cursor, pk=dict(pk))

"""Range values (PostgreSQL ``int4range``, ``tstzrange`` ...) in a driver-free form.

A range travels as PostgreSQL's own text syntax, ``[1,5)``, ``(,2024-01-01)`` or ``empty``,
each bound written as the codec writes that bound alone (ISO for dates and timestamps, digits
for numbers), under the tag ``range:<the bounds' tag>`` (``range:int``, ``range:timestamp``).
The worker rebuilds a :class:`Range`, which has the attributes of psycopg's ``Range``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["Range", "is_range", "parse_range", "range_text"]


@dataclass(frozen=True, slots=True)
class Range:
    """A range value as a handler gets it: bounds, and which of them are included."""

    lower: Any = None
    upper: Any = None
    bounds: str = "[)"
    empty: bool = False

    @property
    def isempty(self) -> bool:
        return self.empty

    @property
    def lower_inc(self) -> bool:
        return not self.empty and self.lower is not None and self.bounds[0] == "["

    @property
    def upper_inc(self) -> bool:
        return not self.empty and self.upper is not None and self.bounds[1] == "]"

    @property
    def lower_inf(self) -> bool:
        return not self.empty and self.lower is None

    @property
    def upper_inf(self) -> bool:
        return not self.empty and self.upper is None


def is_range(value: Any) -> bool:
    """A :class:`Range` or a driver's range (psycopg's): bounds, ``bounds`` and ``isempty``."""
    return isinstance(value, Range) or (
        type(value).__name__ == "Range" and hasattr(value, "isempty") and hasattr(value, "bounds")
    )


def range_text(value: Any, encode: Callable[[Any], tuple[Any, str | None]]) -> tuple[str, str] | None:
    """``(text, tag)`` of a range, its bounds encoded by ``encode``; None when the bounds are not
    one scalar type whose text has no comma (the caller then sends the range's ``str``)."""
    if value.isempty:
        return "empty", "range"
    texts: list[str] = []
    tags: set[str] = set()
    for bound in (value.lower, value.upper):
        if bound is None:
            texts.append("")
            continue
        encoded, tag = encode(bound)
        if tag is None:  # JSON-native bound: name its type so the text parses back to it
            tag = {int: "int", float: "float"}.get(type(bound))
        if tag is None or isinstance(encoded, list | dict) or "," in str(encoded):
            return None
        texts.append(str(encoded))
        tags.add(tag)
    if len(tags) > 1:
        return None
    bounds = value.bounds or "()"
    return f"{bounds[0]}{texts[0]},{texts[1]}{bounds[1]}", "range:" + tags.pop() if tags else "range"


def parse_range(text: Any, bound_tag: str | None, decode: Callable[[Any, str | None], Any]) -> Range:
    """Inverse of :func:`range_text` (``decode`` reads one bound under ``bound_tag``)."""
    if not isinstance(text, str):
        raise ValueError(f"a range is a string, got {text!r}")
    if text == "empty":
        return Range(empty=True)
    if len(text) < 3 or text[0] not in "[(" or text[-1] not in ")]" or "," not in text:
        raise ValueError(f"not a range: {text!r}")
    low, high = text[1:-1].split(",", 1)
    lower = decode(low, bound_tag) if low else None
    upper = decode(high, bound_tag) if high else None
    return Range(lower, upper, text[0] + text[-1])

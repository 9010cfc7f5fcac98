"""Whole columns at once, for pages encoded column by column (poller.tick.events)."""

from __future__ import annotations

import datetime as dt
import math
import uuid
from collections.abc import Callable, Sequence
from decimal import Decimal
from itertools import repeat
from operator import attrgetter
from typing import Any
from zoneinfo import ZoneInfo

import orjson

from shared.codec.values import _SAFE_INT, _iso, encode_value
from shared.errors import SerializationError
from shared.models import Lsn

# Exact types whose tag (and encoding) depends on the type alone: a column of one of them encodes
# with one call per value and one tag for the whole column.
_BY_TYPE: dict[type, tuple[Callable[[Any], Any], str]] = {
    Decimal: (str, "decimal"),
    uuid.UUID: (str, "uuid"),
    dt.date: (dt.date.isoformat, "date"),
    dt.time: (dt.time.isoformat, "time"),
}
_NATIVE = frozenset({str, bool, type(None)})
ColumnTags = str | None | list[str | None]


def encode_column(values: Sequence[Any]) -> tuple[Sequence[Any], ColumnTags]:
    """Encode a column of values exactly as :func:`encode_value` encodes each one.

    Returns the encoded values and their tags: one tag (or None) shared by every value, or a
    list with one tag per value when they differ (a nullable or mixed column). A column of one
    common type costs one C-level pass instead of a type dispatch per value.
    """
    kinds = set(map(type, values))
    if kinds <= _NATIVE:
        return values, None
    present = [v for v in values if v is not None] if type(None) in kinds else values
    kinds.discard(type(None))
    if kinds == {int} and min(present) >= -_SAFE_INT and max(present) <= _SAFE_INT:
        return values, None
    if kinds == {float} and all(map(math.isfinite, present)):
        return values, None
    if len(present) == len(values) and len(kinds) == 1:
        (kind,) = kinds
        if kind in _BY_TYPE:
            encode, tag = _BY_TYPE[kind]
            return list(map(encode, values)), tag
        if kind is dt.datetime and all(v.tzinfo is not None for v in values):
            return list(map(_iso, values)), "timestamp"
    pairs = list(map(encode_value, values))
    tags = [tag for _, tag in pairs]
    return [value for value, _ in pairs], tags[0] if tags.count(tags[0]) == len(tags) else tags


# A column's values as JSON pieces, for pages encoded by bytes %-templates (poller.tick.events).
ColumnJson = tuple[Sequence[Any], bytes, str | None]
_JSON_OPTION = orjson.OPT_NON_STR_KEYS


def column_json(values: Sequence[Any]) -> ColumnJson | None:
    """A non-empty column encoded as :func:`encode_column` does, as JSON: ``(pieces, spec, tag)``,
    where ``spec % piece`` is exactly the bytes :func:`dumps` writes for each encoded value
    inside a document, and ``tag`` is the whole column's one tag.

    Common columns cost one encoder call, not one per value: a string column is one orjson call
    split at its element boundaries (inside a JSON string every ``"`` is escaped, so ``","``
    occurs only between elements), an integer column is formatted by the template (``%d``), and
    the text of a Decimal, UUID, date, time or timestamp never needs escaping. None when the
    values need different tags (a nullable tagged column) or cannot be encoded (the caller then
    takes the value-by-value path, which raises the proper error).
    """
    try:
        return _column_json(values)
    except (TypeError, ValueError, SerializationError):  # orjson's JSONEncodeError is a TypeError
        return None


def _column_json(values: Sequence[Any]) -> ColumnJson | None:
    if not values:
        return None
    kinds = set(map(type, values))
    if len(kinds) == 1:
        (kind,) = kinds
        if kind is int and min(values) >= -_SAFE_INT and max(values) <= _SAFE_INT:
            return values, b"%d", None
        if kind is str:
            return orjson.dumps(values)[2:-2].split(b'","'), b'"%b"', None
        if kind in _BY_TYPE:
            encode, tag = _BY_TYPE[kind]
            return _as_bytes(list(map(encode, values))), b'"%b"', tag
        if kind is dt.datetime and (pieces := _iso_column(values)) is not None:
            return pieces, b'"%b"', "timestamp"
        if kind is Lsn:  # a change's commit LSN: shared by a transaction's rows, formatted once each
            text = {lsn: str(lsn) for lsn in dict.fromkeys(values)}
            return _as_bytes(list(map(text.__getitem__, values))), b'"%b"', "pg_lsn"
    if kinds == _TEXT_OR_NULL:  # a nullable text column: its strings as above, null between them
        quoted = map(b'"%b"'.__mod__, orjson.dumps([v for v in values if v is not None])[2:-2].split(b'","'))
        next_text = quoted.__next__
        return [b"null" if v is None else next_text() for v in values], b"%b", None
    if kinds <= _DOCUMENTS and (pieces := _document_column(values)) is not None:
        return pieces, b"%b", None
    encoded, tags = encode_column(values)
    if isinstance(tags, list):
        return None
    return list(map(orjson.dumps, encoded, repeat(None), repeat(_JSON_OPTION))), b"%b", tags


_DOCUMENTS = frozenset({dict, list, type(None)})
_TEXT_OR_NULL = frozenset({str, type(None)})
_DOCUMENT_OPTION = orjson.OPT_PASSTHROUGH_SUBCLASS  # an int or str subclass is not plain JSON (an Lsn)
# 15 digits or fewer: an integer within 2**53. Every digit made a "0", then one substring search
# (a regex scan costs ten times as much).
_DIGITS_AS_ZERO, _SIXTEEN_DIGITS = bytes.maketrans(b"123456789", b"000000000"), b"0" * 16


def _document_column(values: Sequence[Any]) -> list[bytes] | None:
    """JSON documents (json/jsonb, arrays) that JSON carries exactly, as themselves: each one's
    orjson bytes, which is what :func:`encode_value` gives for such a value (untagged, unchanged).
    None when one might not be exact (then each goes through ``encode_value``): orjson refuses a
    non-string key, an unknown type or a subclass; a NaN or an infinity (written ``null``), a
    datetime, a UUID or a tuple does not read back equal; an integer past 2**53 has 16 digits or
    more (so does a long float or a digit string: they take the slow path, never a wrong one)."""
    try:
        pieces = list(map(orjson.dumps, values, repeat(None), repeat(_DOCUMENT_OPTION)))
    except TypeError:
        return None
    text = b"[" + b",".join(pieces) + b"]"
    if _SIXTEEN_DIGITS in text.translate(_DIGITS_AS_ZERO) or orjson.loads(text) != list(values):
        return None
    return pieces


# A column as JSON pieces whose tags may differ row to row: ``(pieces, spec, tags)``, ``tags`` one
# tag (or None) for the whole column or a list with each row's.
ColumnPieces = tuple[Sequence[Any], bytes, ColumnTags]


def column_pieces(values: Sequence[Any]) -> ColumnPieces | None:
    """:func:`column_json`, also for a column whose values need different tags (a nullable
    Decimal column): then each value's JSON comes from its own encoder call and ``tags`` lists
    each value's tag. None when a value cannot be encoded (the caller's value-by-value path
    raises the proper error)."""
    try:
        if (found := _column_json(values)) is not None:
            return found
        encoded, tags = encode_column(values)
        return list(map(orjson.dumps, encoded, repeat(None), repeat(_JSON_OPTION))), b"%b", tags
    except (TypeError, ValueError, SerializationError):
        return None


def _as_bytes(texts: list[str]) -> list[bytes]:
    """Texts without control characters (a Decimal's, a date's ...) as UTF-8, in three C calls."""
    return "\x1f".join(texts).encode().split(b"\x1f")


def _iso_column(values: Sequence[dt.datetime]) -> list[bytes] | None:
    """:func:`_iso` of every value, from one orjson call: orjson writes the same text except that
    it omits a zero microsecond (those values are formatted one by one) and an offset's seconds
    (then None: the caller formats each value)."""
    if not _whole_minute_offsets(values):
        return None
    text = orjson.dumps(values)
    pieces = text.replace(b'+00:00"', b'Z"')[2:-2].split(b'","')
    if text.count(b".") != len(values):  # some on a whole second
        return [p if b"." in p else _iso(value).encode() for p, value in zip(pieces, values, strict=True)]
    return pieces


_FIXED_UTC = frozenset({"UTC", "Etc/UTC", "Etc/UCT", "Etc/Universal", "Etc/Zulu", "UCT", "Universal", "Zulu"})
_TZINFO = attrgetter("tzinfo")


def _whole_minute_offsets(values: Sequence[dt.datetime]) -> bool:
    """Every value is aware, with an offset of whole minutes (checked once per zone when the
    zone's offset is fixed, the usual case; else per value)."""
    zones = set(map(_TZINFO, values))
    if all(type(z) is dt.timezone or (type(z) is ZoneInfo and z.key in _FIXED_UTC) for z in zones):
        offsets = {z.utcoffset(None) for z in zones}
    else:
        offsets = set(map(dt.datetime.utcoffset, values))
    return None not in offsets and not any(o.seconds % 60 or o.microseconds for o in offsets)

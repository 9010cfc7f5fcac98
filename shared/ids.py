"""Deterministic identifiers: event ids, batch ids, idempotency keys and source fingerprints.

They are pure functions of content, so a batch re-fetched after a failed commit produces the
same ids, and Service Bus duplicate detection (which compares message ids) drops the copy.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import uuid
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import orjson

from shared.codec import dumps, encode_value
from shared.models import CursorValue, Lsn, Position

__all__ = [
    "EventIds",
    "batch_id_for_range",
    "event_id_for",
    "idempotency_key",
    "source_fingerprint",
    "split_message_id",
    "subscription_split_message_id",
]


_HEX = type(hashlib.sha256()).hexdigest


def _digest(*parts: Any) -> str:
    return hashlib.sha256(dumps(list(parts))).hexdigest()


def _default(value: Any) -> Any:
    """Canonical JSON for what orjson does not encode itself (tagged, so types stay distinct)."""
    if isinstance(value, tuple):
        return ["tuple", *value]
    encoded, tag = encode_value(value)
    return [tag, encoded]


def _canonical_bytes(pk: Mapping[str, Any], cursor: CursorValue) -> bytes:
    opts = orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS | orjson.OPT_PASSTHROUGH_DATACLASS
    try:
        return orjson.dumps([pk, cursor], default=_default, option=opts)
    except TypeError:
        # orjson refuses integers beyond 64 bits: fall back to the fully tagged form.
        doc = [sorted((k, _default(v)) for k, v in pk.items()), _default(cursor)]
        try:  # a tuple cursor's parts may need tagging too (a Decimal beside a big key)
            return orjson.dumps(doc, default=_default, option=orjson.OPT_NON_STR_KEYS)
        except TypeError:
            return dumps(doc)  # raises the codec's SerializationError


_CANONICAL_OPTION = orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS | orjson.OPT_PASSTHROUGH_DATACLASS
# Exact types orjson writes as a JSON string of its own (never escaped, never via ``_default``).
_AS_STRING = frozenset({str, dt.datetime, dt.date, dt.time, uuid.UUID})
_I64, _U64 = -(2**63), 2**64 - 1  # orjson's integer range


def _canonical_column(values: Sequence[Any]) -> tuple[Sequence[Any], bytes]:
    """Each value's canonical JSON (as ``_canonical_bytes`` writes it) as ``(pieces, spec)`` for a
    bytes template: one orjson call for a column of one common type. Raises TypeError where
    ``_canonical_bytes`` needs its fallback form (integers beyond 64 bits)."""
    kinds = set(map(type, values))
    if len(kinds) == 1 and values:
        (kind,) = kinds
        if (kind is int or kind is Lsn) and min(values) >= _I64 and max(values) <= _U64:  # orjson: an Lsn is an int
            return values, b"%d"
        if kind in _AS_STRING:
            pieces = orjson.dumps(values, option=_CANONICAL_OPTION)[2:-2].split(b'","')  # see codec.column_json
            if len(pieces) == len(values):
                return pieces, b'"%b"'
        if kind is tuple and len(arity := set(map(len, values))) == 1 and arity != {0}:  # a composite cursor
            parts = [_canonical_column(part) for part in zip(*values, strict=True)]  # part by part
            spec = b"[" + b",".join(p[1] for p in parts) + b"]"
            return list(map(spec.__mod__, zip(*(p[0] for p in parts), strict=True))), b"%b"
    return [orjson.dumps(v, default=_default, option=_CANONICAL_OPTION) for v in values], b"%b"


def _cursor_columns(cursors: Sequence[Any]) -> tuple[list[Sequence[Any]], bytes]:
    """The cursor column's canonical pieces and spec; a composite cursor's parts as one column
    each, under one spec (``[%d,%d]``: no per-row piece for the tuple itself)."""
    if cursors and set(map(type, cursors)) == {tuple} and len(arity := set(map(len, cursors))) == 1 and arity != {0}:
        parts = [_canonical_column(part) for part in zip(*cursors, strict=True)]
        return [p[0] for p in parts], b"[" + b",".join(p[1] for p in parts) + b"]"
    pieces, spec = _canonical_column(cursors)
    return [pieces], spec


class EventIds:
    """Event ids of one poller and source: the hash prefix is computed once (hot path)."""

    def __init__(self, poller: str, fingerprint: str) -> None:
        self._head = dumps(["event", poller, fingerprint])
        self._prefix = hashlib.sha256(self._head)

    def __call__(self, pk: Mapping[str, Any], cursor: CursorValue) -> str:
        h = self._prefix.copy()
        h.update(_canonical_bytes(pk, cursor))
        return "ev-" + h.hexdigest()[:40]

    def many(self, pks: Iterable[Mapping[str, Any]], cursors: Iterable[CursorValue]) -> list[str]:
        """The ids of a page's rows (same as calling this once per row, without the per-call overhead)."""
        prefix, ids = self._prefix, []
        for pk, cursor in zip(pks, cursors, strict=True):
            h = prefix.copy()
            h.update(_canonical_bytes(pk, cursor))
            ids.append("ev-" + h.hexdigest()[:40])
        return ids

    def of_columns(
        self, pk: Mapping[str, Sequence[Any]], cursors: Sequence[CursorValue], index: Sequence[int] | None = None
    ) -> list[str] | None:
        """The same ids as :meth:`many`, from a page's pk columns and cursor column: the canonical
        bytes of every row come from one template (one orjson call a column), and each row is
        hashed once over them. With ``index``, ``cursors`` holds distinct values and ``index`` each
        row's index into them (rows sharing a cursor value encode it once). None when a value
        needs the fallback form (then use ``many``)."""
        try:
            columns = {name: _canonical_column(values) for name, values in pk.items()}
            cursor_columns, cursor_spec = _cursor_columns(cursors)
        except TypeError:
            return None
        if index is not None:
            cursor_columns = [list(map(pieces.__getitem__, index)) for pieces in cursor_columns]
        names = sorted(columns)  # OPT_SORT_KEYS: pk keys in code point order, as orjson sorts them
        keys = [dumps(name).replace(b"%", b"%%") + b":" + columns[name][1] for name in names]
        template = self._head.replace(b"%", b"%%") + b"[{" + b",".join(keys) + b"}," + cursor_spec + b"]"
        rows = zip(*(columns[name][0] for name in names), *cursor_columns, strict=True)
        digests = map(_HEX, map(hashlib.sha256, map(template.__mod__, rows)))
        return list(map("ev-%.40s".__mod__, digests))  # "ev-" and the first 40 hex digits


def event_id_for(poller: str, fingerprint: str, pk: Mapping[str, Any], cursor: CursorValue) -> str:
    """Stable id of one row state: the same row at the same cursor always gets the same id."""
    return EventIds(poller, fingerprint)(pk, cursor)


def batch_id_for_range(poller: str, fingerprint: str, first: Position, last: Position, count: int) -> str:
    """Id of one fetched page: its first and last keyset positions and its size.

    A page starts right after a committed checkpoint, so re-fetching it (after a failed commit, a
    crash or a lost lease) gives the same id without hashing every row. Message ids, which
    duplicate detection compares, still cover every event id.
    """
    bounds = [_canonical_bytes(p.pk, p.cursor).decode() for p in (first, last)]
    return "batch-" + _digest("batch", poller, fingerprint, bounds, count)[:32]


def idempotency_key(poller: str, fingerprint: str, event_ids: Iterable[str]) -> str:
    """Service Bus ``message_id`` for a message carrying exactly these events, in this order."""
    return "msg-" + _digest("message", poller, fingerprint, list(event_ids))[:60]


def split_message_id(event_id: str) -> str:
    """Message id of the single-event message a failing batch is split into (crash-safe: stable)."""
    return "split-" + event_id


def subscription_split_message_id(event_id: str, subscription: str) -> str:
    """Message id of a single split off a failing batch in one topic subscription.

    The singles go back to the topic, whose duplicate detection compares message ids across all
    its subscriptions: two subscriptions splitting the same parent must not send the same ids, or
    the second one's singles would be dropped. The subscription is part of the id (a name cannot
    hold ``:``, so the id is unambiguous); the same parent and subscription give the same ids.
    """
    return f"split-{subscription}:{event_id}"


def source_fingerprint(definition: Mapping[str, Any]) -> str:
    """Hash of the source definition (the URL must already have its password removed)."""
    return "sha256:" + hashlib.sha256(dumps(dict(sorted(definition.items())))).hexdigest()

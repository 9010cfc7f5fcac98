"""Deterministic identifiers: event ids, batch ids, idempotency keys and source fingerprints.

They are pure functions of content, so a batch re-fetched after a failed commit produces the
same ids, and Service Bus duplicate detection (which compares message ids) drops the copy.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from typing import Any

import orjson

from shared.codec import dumps, encode_value
from shared.models import CursorValue, Position

__all__ = [
    "EventIds",
    "batch_id_for_range",
    "event_id_for",
    "idempotency_key",
    "source_fingerprint",
    "split_message_id",
]


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
        return dumps([sorted((k, _default(v)) for k, v in pk.items()), _default(cursor)])


class EventIds:
    """Event ids of one poller and source: the hash prefix is computed once (hot path)."""

    def __init__(self, poller: str, fingerprint: str) -> None:
        self._prefix = hashlib.sha256(dumps(["event", poller, fingerprint]))

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


def source_fingerprint(definition: Mapping[str, Any]) -> str:
    """Hash of the source definition (the URL must already have its password removed)."""
    return "sha256:" + hashlib.sha256(dumps(dict(sorted(definition.items())))).hexdigest()

"""The batch envelope (DESIGN §3.2; per-event "types" is our extension for exact round-trips)."""

from __future__ import annotations

import datetime as dt
from typing import Any

from shared.codec.cursors import _decode_cursor, _decode_map, _encode_cursor, _encode_map, dumps
from shared.codec.values import _iso
from shared.errors import EnvelopeError, SerializationError
from shared.models import Batch, RowChange


def _has_tags(tag: Any) -> bool:
    # A composite cursor always keeps its tag list: it is what tells a tuple from a JSON array.
    return isinstance(tag, list) or tag is not None


def encode_event(event: RowChange) -> dict[str, Any]:
    cursor, cursor_tag = _encode_cursor(event.cursor)
    pk, pk_tags = _encode_map(event.pk)
    out: dict[str, Any] = {
        "event_id": event.event_id,
        "op": event.op,
        "pk": pk,
        "cursor": cursor,
        "after": None,
        "before": None,
    }
    types: dict[str, Any] = {}
    if _has_tags(cursor_tag):
        types["cursor"] = cursor_tag
    if pk_tags:
        types["pk"] = pk_tags
    if event.after is not None:
        out["after"], after_tags = _encode_map(event.after)
        if after_tags:
            types["after"] = after_tags
    if event.before is not None:  # change-log sources: the old key, or the old row
        out["before"], before_tags = _encode_map(event.before)
        if before_tags:
            types["before"] = before_tags
    if types:
        out["types"] = types
    if event.change is not None:  # optional: absent for cursor polling, so its bodies are unchanged
        out["change"] = event.change
    if event.table is not None:  # optional: absent for a query poller (and in older messages)
        out["table"] = event.table
    if event.committed_at is not None:  # optional: change-log sources' commit time (telemetry)
        out["committed_at"] = _iso(event.committed_at)
    return out


def _envelope_extras(batch: Batch) -> dict[str, Any]:
    """The envelope's optional top-level fields; absent when unset (old readers ignore them)."""
    extras: dict[str, Any] = {}
    if batch.read_at is not None:
        extras["read_at"] = _iso(batch.read_at)
    if batch.traceparent is not None:
        extras["traceparent"] = batch.traceparent
    if batch.epoch:  # the order epoch (RowChange.epoch): absent while 0, so older bodies are unchanged
        extras["epoch"] = batch.epoch
    return extras


def envelope_header(batch: Batch) -> dict[str, Any]:
    """The envelope without its events' content: ``events`` is the last key, an empty list."""
    return {
        "schema": batch.schema,
        "poller": batch.poller,
        "batch_id": batch.batch_id,
        "source_fingerprint": batch.source_fingerprint,
        **_envelope_extras(batch),
        "events": [],
    }


def _optional_time(value: Any) -> dt.datetime | None:
    """An optional telemetry timestamp: an ISO string with an offset, else None (never fails a message)."""
    if type(value) is not str:
        return None
    try:
        parsed = dt.datetime.fromisoformat(value)
    except ValueError:
        return None
    return parsed if parsed.tzinfo is not None else None


def encode_batch(batch: Batch, events: tuple[RowChange, ...] | None = None) -> bytes:
    """Encode a batch (or a slice of its events) as the message body."""
    doc = envelope_header(batch)
    doc["events"] = [encode_event(e) for e in (batch.events if events is None else events)]
    return dumps(doc)


def decode_event(raw: Any, poller: str) -> RowChange:
    """Decode one event object of an envelope (inverse of :func:`encode_event`)."""
    if not isinstance(raw, dict):
        raise EnvelopeError("each event must be a JSON object")
    missing = [k for k in ("event_id", "op", "pk", "cursor") if k not in raw]
    if missing:
        raise EnvelopeError(f"event is missing {', '.join(missing)}")
    if raw["op"] not in ("upsert", "delete"):
        raise EnvelopeError(f"event op must be upsert or delete, got {raw['op']!r}")
    if not isinstance(raw["event_id"], str) or not isinstance(raw["pk"], dict):
        raise EnvelopeError("event_id must be a string and pk an object")
    types = raw.get("types") or {}
    after = raw.get("after")
    if after is not None and not isinstance(after, dict):
        raise EnvelopeError("event after must be an object or null")
    before = raw.get("before")
    if before is not None and not isinstance(before, dict):
        raise EnvelopeError("event before must be an object or null")
    change = raw.get("change")
    if change is not None and not isinstance(change, str):
        raise EnvelopeError("event change must be a string when present")
    table = raw.get("table")
    if table is not None and not isinstance(table, str):
        raise EnvelopeError("event table must be a string when present")
    try:
        return RowChange(
            event_id=raw["event_id"],
            op=raw["op"],
            pk=_decode_map(raw["pk"], types.get("pk") or {}),
            cursor=_decode_cursor(raw["cursor"], types.get("cursor")),
            after=None if after is None else _decode_map(after, types.get("after") or {}),
            poller=poller,
            before=None if before is None else _decode_map(before, types.get("before") or {}),
            change=change,
            table=table,
            committed_at=_optional_time(raw.get("committed_at")),
        )
    except SerializationError as exc:
        raise EnvelopeError(f"event {raw['event_id']}: {exc}") from exc

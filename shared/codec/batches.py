"""Decoding a message body: :func:`decode_batch`, and every event of it at once."""

from __future__ import annotations

from typing import Any

from shared.codec.cursors import _decode_cursor, _json_object
from shared.codec.envelope import _optional_time, decode_event
from shared.codec.values import decode_value
from shared.errors import EnvelopeError, SerializationError
from shared.models import BATCH_SCHEMA, Batch, RowChange


def decode_batch(data: bytes | str) -> Batch:
    """Decode and validate a message body; anything foreign is an :class:`EnvelopeError`."""
    raw = _json_object(data, EnvelopeError, "message body")
    if raw.get("schema") != BATCH_SCHEMA:
        raise EnvelopeError(f"unknown message schema {raw.get('schema')!r} (expected {BATCH_SCHEMA!r})")
    poller, batch_id, fingerprint, events = (
        raw.get("poller"),
        raw.get("batch_id"),
        raw.get("source_fingerprint"),
        raw.get("events"),
    )
    if not isinstance(poller, str) or not isinstance(batch_id, str) or not isinstance(fingerprint, str):
        raise EnvelopeError("poller, batch_id and source_fingerprint must be strings")
    if not isinstance(events, list) or not events:
        raise EnvelopeError("events must be a non-empty list")
    traceparent = raw.get("traceparent")
    # The order epoch: every event's (absent: 0). It orders changes, so a malformed one fails the message.
    epoch = raw.get("epoch", 0)
    if type(epoch) is not int or epoch < 0:
        raise EnvelopeError(f"epoch must be a non-negative integer when present, got {epoch!r}")
    decoded = decode_events(events, poller)
    if epoch:
        for event in decoded:  # each one just built by decode_events: set like its other slots
            _set_epoch(event, epoch)
    return Batch(
        poller=poller,
        batch_id=batch_id,
        source_fingerprint=fingerprint,
        events=decoded,
        read_at=_optional_time(raw.get("read_at")),
        traceparent=traceparent if type(traceparent) is str else None,
        epoch=epoch,
    )


_OPS = frozenset({"upsert", "delete"})
# RowChange's slot setters, in field order: a frozen dataclass's __init__ sets each field through
# object.__setattr__, about twice the cost of these; decoding builds one RowChange per event.
_new_event = object.__new__
(
    _set_event_id,
    _set_op,
    _set_pk,
    _set_cursor,
    _set_after,
    _set_poller,
    _set_before,
    _set_source,
    _set_change,
    _set_table,
    _set_committed_at,
    _set_epoch,
) = (getattr(RowChange, name).__set__ for name in RowChange.__slots__)


def decode_events(raws: list[Any], poller: str) -> tuple[RowChange, ...]:
    """Decode an envelope's events at once: equal to ``decode_event`` on each, with less work per event.

    Values without a type tag are used as parsed (the pk and after objects are orjson's own
    dicts, not copies); only tagged values are converted. An event the fast path does not
    accept exactly as :func:`decode_event` would is handed to :func:`decode_event`, which decodes
    it or raises its precise error. One loop, inlined on purpose (over ~60 lines): it runs once per
    event a worker receives, and a call per field costs more than the rest of the decode.
    """
    out: list[RowChange] = []
    append = out.append
    str_, dict_, ops = str, dict, _OPS
    for raw in raws:
        try:
            event_id, op, pk, cursor = raw["event_id"], raw["op"], raw["pk"], raw["cursor"]
        except (KeyError, TypeError, AttributeError):  # not an object, or a field missing
            append(decode_event(raw, poller))  # raises the precise error
            continue
        if type(raw) is not dict_:
            append(decode_event(raw, poller))
            continue
        after, before, change, types = raw.get("after"), raw.get("before"), raw.get("change"), raw.get("types")
        table = raw.get("table")
        if (
            op not in ops
            or type(event_id) is not str_
            or type(pk) is not dict_
            or (after is not None and type(after) is not dict_)
            or (before is not None and type(before) is not dict_)
            or (change is not None and type(change) is not str_)
            or (table is not None and type(table) is not str_)
        ):
            append(decode_event(raw, poller))  # raises the precise error
            continue
        if types:
            try:
                if type(types) is not dict_:
                    raise _Slow
                tag = types.get("cursor")
                if tag is not None:
                    cursor = _decode_cursor(cursor, tag)
                pk = _tagged(pk, types.get("pk"))
                if after is not None:
                    after = _tagged(after, types.get("after"))
                if before is not None:
                    before = _tagged(before, types.get("before"))
            except (_Slow, SerializationError, TypeError, AttributeError, ValueError):
                append(decode_event(raw, poller))  # decodes it, or raises the precise error
                continue
        event = _new_event(RowChange)
        _set_event_id(event, event_id)
        _set_op(event, op)
        _set_pk(event, pk)
        _set_cursor(event, cursor)
        _set_after(event, after)
        _set_poller(event, poller)
        _set_before(event, before)
        _set_source(event, {})
        _set_change(event, change)
        _set_table(event, table)
        committed = raw.get("committed_at")
        _set_committed_at(event, None if committed is None else _optional_time(committed))
        _set_epoch(event, 0)  # the envelope's: decode_batch sets it
        append(event)
    return tuple(out)


class _Slow(Exception):
    """An event the fast path leaves to :func:`decode_event`."""


def _tagged(values: dict[str, Any], tags: Any) -> dict[str, Any]:
    """``values`` with its tagged entries decoded (a copy; untagged maps are returned as they are)."""
    if not tags:
        return values
    if type(tags) is not dict:
        raise _Slow
    out = dict(values)
    for key, tag in tags.items():
        if key in out:
            out[key] = decode_value(out[key], tag)
    return out

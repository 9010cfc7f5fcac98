"""The one JSON codec (orjson) for values, cursors, state blobs and batch envelopes.

Values that JSON cannot carry natively travel as strings with a *type tag* next to them, so
they round-trip exactly (a tz-aware datetime to the microsecond and its offset, a 200-digit
integer, a Decimal with its exponent, a UUID, bytes) while staying readable from other
languages. Tags are sparse: a value JSON carries as-is has none.
"""

from __future__ import annotations

import base64
import datetime as dt
import math
import uuid
from collections.abc import Callable, Mapping, Sequence
from decimal import Decimal, InvalidOperation
from itertools import repeat
from operator import attrgetter
from typing import Any
from zoneinfo import ZoneInfo

import orjson

from shared.errors import EnvelopeError, SerializationError, StateFormatError
from shared.models import (
    BATCH_SCHEMA,
    STATE_VERSION,
    Batch,
    Checkpoint,
    CursorValue,
    Lease,
    Lsn,
    Position,
    RowChange,
    SnapshotState,
    StateDoc,
)

__all__ = [
    "column_json",
    "decode_batch",
    "decode_event",
    "decode_events",
    "decode_state",
    "decode_value",
    "dumps",
    "encode_batch",
    "encode_column",
    "encode_event",
    "encode_state",
    "encode_value",
    "loads",
    "tag_of",
]

# Integers beyond this travel as strings: JavaScript and many JSON parsers lose precision past 2**53.
_SAFE_INT = 2**53 - 1


def tag_of(value: Any) -> str | None:
    """The type tag a value needs in JSON, or None when JSON carries it natively."""
    if value is None or isinstance(value, bool | str):
        return None
    if isinstance(value, int):
        return "pg_lsn" if isinstance(value, Lsn) else None if -_SAFE_INT <= value <= _SAFE_INT else "int"
    if isinstance(value, float):
        return None if math.isfinite(value) else "float"
    if isinstance(value, dt.datetime):
        return "timestamp" if value.tzinfo is not None else "datetime"
    if isinstance(value, dt.date):
        return "date"
    if isinstance(value, dt.time):
        return "time"
    if isinstance(value, Decimal):
        return "decimal"
    if isinstance(value, uuid.UUID):
        return "uuid"
    if isinstance(value, bytes | bytearray | memoryview):
        return "bytes"
    if isinstance(value, dt.timedelta):
        return "interval"
    if isinstance(value, list | tuple | dict):
        return None
    raise SerializationError(f"cannot encode a value of type {type(value).__name__}")


def _iso(value: dt.datetime) -> str:
    text = value.isoformat(timespec="microseconds")
    return text[:-6] + "Z" if text.endswith("+00:00") else text


def encode_value(value: Any) -> tuple[Any, str | None]:
    """Encode one value to ``(json_value, tag)``."""
    tag = tag_of(value)
    if tag is None:
        if isinstance(value, list | tuple):
            return [_plain(v) for v in value], None
        if isinstance(value, dict):
            return {str(k): _plain(v) for k, v in value.items()}, None
        return value, None
    if tag == "int" or tag == "decimal" or tag == "uuid" or tag == "float" or tag == "pg_lsn":
        return str(value), tag
    if tag in ("timestamp", "datetime"):
        return _iso(value), tag
    if tag in ("date", "time"):
        return value.isoformat(), tag
    if tag == "bytes":
        return base64.b64encode(bytes(value)).decode("ascii"), tag
    if tag == "interval":
        return value.total_seconds(), tag
    raise SerializationError(f"no encoder for tag {tag}")  # pragma: no cover - tag_of is exhaustive


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
    encoded, tags = encode_column(values)
    if isinstance(tags, list):
        return None
    return list(map(orjson.dumps, encoded, repeat(None), repeat(_JSON_OPTION))), b"%b", tags


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


def _plain(value: Any) -> Any:
    """Encode a value nested inside a JSON column (no tags: best-effort readable form)."""
    encoded, _ = encode_value(value)
    return encoded


_DECODERS: dict[str, Any] = {
    "int": int,
    "decimal": Decimal,
    "uuid": uuid.UUID,
    "float": float,
    "timestamp": dt.datetime.fromisoformat,
    "datetime": dt.datetime.fromisoformat,
    "date": dt.date.fromisoformat,
    "time": dt.time.fromisoformat,
    "bytes": base64.b64decode,
    "interval": lambda s: dt.timedelta(seconds=s),
    "pg_lsn": Lsn.parse,
}


def decode_value(value: Any, tag: str | None) -> Any:
    """Inverse of :func:`encode_value`."""
    if tag is None:
        return value
    decoder = _DECODERS.get(tag)
    if decoder is None:
        raise SerializationError(f"unknown type tag {tag!r}")
    try:
        result = decoder(value)
    except (ValueError, TypeError, InvalidOperation) as exc:
        raise SerializationError(f"cannot decode {value!r} as {tag}") from exc
    if tag == "timestamp" and result.tzinfo is None:
        raise SerializationError(f"timestamp {value!r} has no UTC offset")
    return result


def _encode_map(values: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    out: dict[str, Any] = {}
    tags: dict[str, str] = {}
    for key, value in values.items():
        out[key], tag = encode_value(value)
        if tag is not None:
            tags[key] = tag
    return out, tags


def _decode_map(values: Mapping[str, Any], tags: Mapping[str, str]) -> dict[str, Any]:
    return {key: decode_value(value, tags.get(key)) for key, value in values.items()}


def _encode_cursor(cursor: CursorValue) -> tuple[Any, Any]:
    if isinstance(cursor, tuple):
        parts = [encode_value(v) for v in cursor]
        return [p[0] for p in parts], [p[1] for p in parts]
    return encode_value(cursor)


def _decode_cursor(value: Any, tag: Any) -> CursorValue:
    if isinstance(tag, list):
        if not isinstance(value, list) or len(value) != len(tag):
            raise SerializationError("composite cursor value and its type tags differ in length")
        return tuple(decode_value(v, t) for v, t in zip(value, tag, strict=True))
    decoded: CursorValue = decode_value(value, tag)
    return decoded


def cursor_kind(cursor: CursorValue) -> str:
    """The seed-002 ``kind`` string, e.g. ``timestamp+pk`` or ``composite+pk``."""
    if isinstance(cursor, tuple):
        return "composite+pk"
    if isinstance(cursor, Lsn):
        return "pg_lsn"  # value: the commit LSN; tiebreaker: the change's position in the transaction
    tag = tag_of(cursor)
    if tag is None:
        tag = {bool: "bool", int: "int", str: "string", float: "float"}.get(type(cursor), "value")
    return f"{tag}+pk"


# --------------------------------------------------------------------------------------------
# Generic JSON


def dumps(obj: Any) -> bytes:
    """orjson with the options every dbfanout document uses."""
    try:
        return orjson.dumps(obj, option=orjson.OPT_NON_STR_KEYS)
    except TypeError as exc:
        raise SerializationError(f"cannot encode document: {exc}") from exc


def loads(data: bytes | str) -> Any:
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise SerializationError(f"not valid JSON: {exc}") from exc


# --------------------------------------------------------------------------------------------
# State blob (seed 002 §4; "types" is our extension so cursor values round-trip exactly)


def _ts(value: dt.datetime | None) -> str | None:
    return None if value is None else _iso(value)


def _parse_ts(value: Any, field_name: str) -> dt.datetime | None:
    if value is None:
        return None
    try:
        parsed = dt.datetime.fromisoformat(value)
    except (TypeError, ValueError) as exc:
        raise StateFormatError(f"state field {field_name} is not an ISO timestamp: {value!r}") from exc
    if parsed.tzinfo is None:
        raise StateFormatError(f"state field {field_name} has no UTC offset: {value!r}")
    return parsed


def encode_position(position: Position | None) -> dict[str, Any] | None:
    if position is None:
        return None
    value, value_tag = _encode_cursor(position.cursor)
    tiebreaker, pk_tags = _encode_map(position.pk)
    return {
        "kind": cursor_kind(position.cursor),
        "value": value,
        "tiebreaker": tiebreaker,
        "types": {"value": value_tag, "tiebreaker": pk_tags},
    }


def decode_position(raw: Any) -> Position | None:
    if raw is None:
        return None
    if not isinstance(raw, dict) or "value" not in raw or not isinstance(raw.get("tiebreaker"), dict):
        raise StateFormatError("checkpoint.cursor must hold kind, value and tiebreaker")
    types = raw.get("types") or {}
    try:
        return Position(
            cursor=_decode_cursor(raw["value"], types.get("value")),
            pk=_decode_map(raw["tiebreaker"], types.get("tiebreaker") or {}),
        )
    except SerializationError as exc:
        raise StateFormatError(f"checkpoint.cursor cannot be decoded: {exc}") from exc


def encode_snapshot(state: SnapshotState) -> dict[str, Any]:
    """A snapshot's state as the blob keeps it (``checkpoint.snapshot``, beside the cursor)."""
    out: dict[str, Any] = {
        "id": state.id,
        "tables": list(state.tables),
        "chunk_size": state.chunk_size,
        "where": state.where,
        "last_key": None,
        "rows": state.rows,
        "chunks": state.chunks,
        "estimate": state.estimate,
        "started_at": _ts(state.started_at),
        "finished_at": _ts(state.finished_at),
        "cancelled": state.cancelled,
        "error": state.error,
    }
    if state.refused:  # absent otherwise: blobs as before
        out["refused"] = state.refused
    if state.failures:
        out["failures"] = state.failures
    if state.last_key is not None:
        out["last_key"], tags = _encode_map(state.last_key)
        if tags:
            out["types"] = {"last_key": tags}
    return out


def decode_snapshot(raw: Any) -> SnapshotState | None:
    """Inverse of :func:`encode_snapshot` (None when the blob has no snapshot: older blobs)."""
    if raw is None:
        return None
    try:
        tables, last_key = raw["tables"], raw.get("last_key")
        if not isinstance(tables, list) or not all(isinstance(t, str) for t in tables):
            raise StateFormatError("checkpoint.snapshot.tables must be a list of table names")
        for name in ("chunk_size", "rows", "chunks", "refused", "failures"):
            if not isinstance(raw.get(name, 0), int):
                raise StateFormatError(f"checkpoint.snapshot.{name} must be an integer")
        tags = (raw.get("types") or {}).get("last_key") or {}
        return SnapshotState(
            id=str(raw["id"]),
            tables=tuple(tables),
            chunk_size=raw["chunk_size"],
            where=raw.get("where"),
            last_key=None if last_key is None else _decode_map(last_key, tags),
            rows=raw.get("rows", 0),
            chunks=raw.get("chunks", 0),
            estimate=raw.get("estimate"),
            started_at=_parse_ts(raw.get("started_at"), "checkpoint.snapshot.started_at"),
            finished_at=_parse_ts(raw.get("finished_at"), "checkpoint.snapshot.finished_at"),
            cancelled=bool(raw.get("cancelled", False)),
            error=raw.get("error"),
            refused=raw.get("refused", 0),
            failures=raw.get("failures", 0),
        )
    except (KeyError, TypeError, AttributeError, SerializationError) as exc:
        if isinstance(exc, StateFormatError):
            raise
        raise StateFormatError(f"checkpoint.snapshot cannot be decoded: {exc!r}") from exc


def encode_state(doc: StateDoc) -> bytes:
    cp, lease = doc.checkpoint, doc.lease
    checkpoint: dict[str, Any] = {
        "cursor": encode_position(cp.position),
        "last_successful_batch_id": cp.last_successful_batch_id,
        "updated_at": _ts(cp.updated_at),
        "metadata": dict(cp.metadata),
    }
    if cp.position is not None and cp.position.snapshot is not None:  # absent otherwise: blobs as before
        checkpoint["snapshot"] = encode_snapshot(cp.position.snapshot)
    return dumps(
        {
            "version": doc.version,
            "poller_name": doc.poller_name,
            "source_fingerprint": doc.source_fingerprint,
            "checkpoint": checkpoint,
            "lease": {
                "owner_id": lease.owner_id,
                "fencing_token": lease.fencing_token,
                "acquired_at": _ts(lease.acquired_at),
                "heartbeat_at": _ts(lease.heartbeat_at),
                "expires_at": _ts(lease.expires_at),
            },
        }
    )


def _json_object(data: bytes | str, error: type[SerializationError], what: str) -> dict[str, Any]:
    """``data`` parsed as a JSON object; ``error`` (naming ``what``) when it is not one."""
    try:
        raw = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise error(f"{what} is not JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise error(f"{what} must be a JSON object")
    return raw


def decode_state(data: bytes | str) -> StateDoc:
    """Decode a state blob; anything unexpected is a :class:`StateFormatError`, never a guess."""
    raw = _json_object(data, StateFormatError, "state blob")
    if raw.get("version") != STATE_VERSION:
        raise StateFormatError(
            f"state blob version {raw.get('version')!r} is not supported (this dbfanout reads {STATE_VERSION})",
            hint="upgrade dbfanout, or restore the backup written by the newer version's reset",
        )
    try:
        cp_raw = raw["checkpoint"] or {}
        lease_raw = raw["lease"] or {}
        position = decode_position(cp_raw.get("cursor"))
        snapshot = decode_snapshot(cp_raw.get("snapshot"))
        if position is not None and snapshot is not None:
            position = Position(position.cursor, position.pk, snapshot)
        checkpoint = Checkpoint(
            position=position,
            last_successful_batch_id=cp_raw.get("last_successful_batch_id"),
            updated_at=_parse_ts(cp_raw.get("updated_at"), "checkpoint.updated_at"),
            metadata=dict(cp_raw.get("metadata") or {}),
        )
        token = lease_raw.get("fencing_token", 0)
        if not isinstance(token, int) or isinstance(token, bool) or token < 0:
            raise StateFormatError(f"lease.fencing_token must be a non-negative integer, got {token!r}")
        lease = Lease(
            owner_id=lease_raw.get("owner_id") or None,
            fencing_token=token,
            acquired_at=_parse_ts(lease_raw.get("acquired_at"), "lease.acquired_at"),
            heartbeat_at=_parse_ts(lease_raw.get("heartbeat_at"), "lease.heartbeat_at"),
            expires_at=_parse_ts(lease_raw.get("expires_at"), "lease.expires_at"),
        )
        poller_name = raw["poller_name"]
        fingerprint = raw["source_fingerprint"]
    except (KeyError, TypeError, AttributeError) as exc:
        raise StateFormatError(f"state blob is missing or mistypes a field: {exc!r}") from exc
    if not isinstance(poller_name, str) or not isinstance(fingerprint, str):
        raise StateFormatError("poller_name and source_fingerprint must be strings")
    return StateDoc(
        poller_name=poller_name,
        source_fingerprint=fingerprint,
        checkpoint=checkpoint,
        lease=lease,
        version=STATE_VERSION,
    )


# --------------------------------------------------------------------------------------------
# Batch envelope (DESIGN §3.2; per-event "types" is our extension for exact round-trips)


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
    it or raises its precise error.
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

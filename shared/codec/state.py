"""The state blob (seed 002 §4; "types" is our extension so cursor values round-trip exactly).

Its cursors and keys use :func:`~shared.codec.values.exact_value`: a value that would not
decode back to itself is refused here, never stored.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from shared.codec.cursors import (
    _decode_cursor,
    _decode_map,
    _encode_cursor,
    _encode_map,
    _json_object,
    cursor_kind,
    dumps,
)
from shared.codec.values import _iso
from shared.errors import SerializationError, StateFormatError
from shared.models import STATE_VERSION, Checkpoint, Lease, Position, SnapshotState, StateDoc


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
    value, value_tag = _encode_cursor(position.cursor, exact=True)
    tiebreaker, pk_tags = _encode_map(position.pk, exact=True)
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
        out["last_key"], tags = _encode_map(state.last_key, exact=True)
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

"""The signal table's rows: snapshot requests and cancels, and a chunk's high watermark.

Requests (``dbfanout snapshot``) are rows of the poller's signal table, like the watermarks its
chunk reads write (:mod:`poller.snapshot.chunks`): they arrive through the log, in order with the
changes, and never race the poller's own state writes. This module reads them as the log carries
them (:func:`signal_of`), turns a request into the snapshot's next state (:func:`apply_request`)
and gives a request row's values (:func:`request_params`); each database's upsert of them is its
own (:mod:`poller.snapshot.postgres`, :mod:`poller.snapshot.mysql`).
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from poller.snapshot.chunks import chunk_size, qualified
from shared.codec import dumps, loads
from shared.config import PollerConfig
from shared.models import SnapshotState

__all__ = ["KIND_REQUEST", "KIND_WATERMARK", "apply_request", "request_params", "signal_of"]

KIND_WATERMARK = "watermark"
KIND_REQUEST = "request"


def request_params(
    config: PollerConfig,
    *,
    tables: Sequence[str] | None = None,
    where: str | None = None,
    chunk_size: int | None = None,
    cancel: bool = False,
) -> dict[str, Any]:
    """A request row's values (a new id each time), whatever the database's upsert looks like."""
    data: dict[str, Any] = {"action": "cancel"} if cancel else {
        "action": "snapshot",
        "tables": list(tables) if tables else None,
        "where": where,
        "chunk_size": chunk_size,
    }  # fmt: skip
    return {"poller": config.name, "kind": KIND_REQUEST, "id": uuid.uuid4().hex, "data": dumps(data).decode()}


def apply_request(
    config: PollerConfig,
    state: SnapshotState | None,
    data: Mapping[str, Any],
    request_id: str,
    at: dt.datetime,
    *,
    qualify: Callable[[str], str] = qualified,
) -> tuple[SnapshotState | None, str | None]:
    """The state after a request row read from the log, and a warning when it was refused
    (``qualify``: how the log names a table)."""
    action = data.get("action")
    if action == "cancel":
        if state is None or not state.active:
            return state, None
        return replace(state, tables=(), last_key=None, finished_at=at, cancelled=True), None
    if action != "snapshot":
        return state, f"request {request_id}: unknown action {action!r} ignored"
    known = [qualify(t) for t in config.tables]
    asked = data.get("tables") or known
    tables = [qualify(str(t)) for t in asked]
    unknown = [t for t in tables if t not in known]
    if unknown:
        return state, f"request {request_id}: {', '.join(unknown)} not among the poller's tables; ignored"
    where = data.get("where")
    return SnapshotState(
        id=request_id,
        tables=tuple(tables),
        chunk_size=chunk_size(config, data.get("chunk_size")),
        where=where if isinstance(where, str) and where.strip() else None,
        started_at=at,
    ), None


def signal_of(new: Mapping[str, Any] | None, poller: str) -> tuple[str, str, dict[str, Any]] | None:
    """``(kind, id, data)`` of a signal row of ``poller`` as the log carries it (None: not ours)."""
    if not new or new.get("poller") != poller:
        return None
    kind, signal_id, data = new.get("kind"), new.get("id"), new.get("data")
    if not isinstance(kind, str) or not isinstance(signal_id, str):
        return None
    try:
        parsed = loads(data) if isinstance(data, str) else {}
    except Exception:
        parsed = {}
    return kind, signal_id, parsed if isinstance(parsed, dict) else {}
